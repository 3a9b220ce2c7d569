//! The membership part of [`SqliteLeaseStore`]: heartbeat rows, the membership read and the
//! membership view, beside the lease rows of the parent module.

use super::*;
use changefeed::lease::MembershipStore;

#[async_trait]
impl MembershipStore for SqliteLeaseStore {
    async fn heartbeat(
        &self,
        group: &GroupName,
        host: &HostName,
        incarnation: &str,
        written_at: Timestamp,
        expected: Option<Version>,
        role: HeartbeatRole,
        report: Option<&str>,
    ) -> Result<Heartbeat, LeaseError> {
        self.write_heartbeat(
            group,
            host,
            incarnation,
            written_at,
            expected,
            role == HeartbeatRole::Leader,
            report,
        )
        .await
    }

    async fn remove_heartbeat(
        &self,
        group: &GroupName,
        host: &HostName,
        incarnation: &str,
        expected: Version,
    ) -> Result<(), LeaseError> {
        let (group, host) = (group.clone(), host.clone());
        let incarnation = incarnation.to_string();
        self.run("remove_heartbeat", format!("{group}/{host}"), move |conn| {
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            match read_heartbeat(&tx, &group, &host)? {
                None => return Ok(()),
                Some(row) if row.version == expected && *row.incarnation == *incarnation => {}
                Some(row) => {
                    return Err(LeaseError::HeartbeatConflict {
                        group: group.to_string(),
                        host: host.to_string(),
                        current: Some(Box::new(row)),
                    }
                    .into())
                }
            }
            tx.prepare_cached(
                "DELETE FROM changefeed_heartbeats WHERE group_name = ?1 AND host = ?2",
            )?
            .execute(params![group.as_str(), host.as_str()])?;
            tx.commit()?;
            Ok(())
        })
        .await
    }

    async fn membership(&self, group: &GroupName) -> Result<Membership, LeaseError> {
        let group = group.clone();
        self.run("membership", group.to_string(), move |conn| {
            // One read transaction: the heartbeats and the counter are one snapshot.
            let tx = conn.transaction()?;
            let mut hosts = Vec::new();
            {
                let mut stmt = tx.prepare_cached(
                    "SELECT host, incarnation, version, written_at, report FROM changefeed_heartbeats
                     WHERE group_name = ?1 ORDER BY host",
                )?;
                let mut rows = stmt.query([group.as_str()])?;
                while let Some(row) = rows.next()? {
                    hosts.push(parse_heartbeat(&group, row)?);
                }
            }
            let counter = CounterRow::read(&tx, &group)?;
            tx.commit()?;
            Ok(Membership {
                hosts,
                change_counter: counter.counter(),
            })
        })
        .await
    }

    async fn head(&self, group: &GroupName) -> Result<Option<GroupHead>, LeaseError> {
        let group = group.clone();
        self.run("head", group.to_string(), move |conn| {
            let head = read_head(conn, &group)?;
            Ok(Some(head))
        })
        .await
    }

    async fn write_view(
        &self,
        group: &GroupName,
        view: &MembershipView,
        expected: u64,
    ) -> Result<MembershipView, LeaseError> {
        let group = group.clone();
        let mut stored = view.clone();
        stored.version = expected + 1;
        self.run("write_view", group.to_string(), move |conn| {
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            let current = read_head(&tx, &group)?;
            if current.view.as_ref().map_or(0, |v| v.version) != expected {
                return Err(LeaseError::ViewConflict {
                    group: group.to_string(),
                    expected,
                    current: current.view.map(Box::new),
                }
                .into());
            }
            let json = serde_json::to_string(&stored)
                .map_err(|e| LeaseError::store("write_view", Some(group.to_string()), false, e))?;
            let version = i64::try_from(stored.version).map_err(|_| {
                LeaseError::store(
                    "write_view",
                    Some(group.to_string()),
                    false,
                    format!(
                        "view version {} does not fit SQLite's INTEGER",
                        stored.version
                    ),
                )
            })?;
            tx.prepare_cached(
                "INSERT INTO changefeed_groups (group_name, change_counter, changes_from,
                   stamped_counter, view_version, view, view_leader, view_leader_incarnation,
                   view_leader_heartbeat)
                 VALUES (?1, 0, 0, 0, ?2, ?3, ?4, ?5, ?6)
                 ON CONFLICT (group_name) DO UPDATE SET view_version = excluded.view_version,
                   view = excluded.view, view_leader = excluded.view_leader,
                   view_leader_incarnation = excluded.view_leader_incarnation,
                   view_leader_heartbeat = excluded.view_leader_heartbeat",
            )?
            .execute(params![
                group.as_str(),
                version,
                json,
                stored.leader.as_str(),
                &*stored.leader_incarnation,
                to_sql_version(stored.leader_heartbeat)?,
            ])?;
            tx.commit()?;
            Ok(stored)
        })
        .await
    }
}
