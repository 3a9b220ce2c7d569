//! The membership part of [`PostgresLeaseStore`]: heartbeat rows, the membership read and the
//! membership view, beside the lease rows of the parent module.

use super::*;
use changefeed::lease::MembershipStore;

#[async_trait]
impl MembershipStore for PostgresLeaseStore {
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

    async fn head(&self, group: &GroupName) -> Result<Option<GroupHead>, LeaseError> {
        let g = group.to_string();
        let rows = self.query("head", g.clone(), &self.sql.head, &[&g]).await?;
        let Some(row) = rows.first() else {
            return Ok(Some(GroupHead::default()));
        };
        let unreadable = |why: String| {
            LeaseError::store(
                "head",
                Some(g.clone()),
                false,
                format!("the membership view of group {group} cannot be read: {why}"),
            )
        };
        let counter: i64 = row.try_get(0).map_err(|e| unreadable(e.to_string()))?;
        let version: i64 = row.try_get(1).map_err(|e| unreadable(e.to_string()))?;
        let json: Option<String> = row.try_get(2).map_err(|e| unreadable(e.to_string()))?;
        let leader_heartbeat: i64 = row.try_get(3).map_err(|e| unreadable(e.to_string()))?;
        let view = match (version, json) {
            (0, _) | (_, None) => None,
            (version, Some(json)) => {
                let mut view: MembershipView =
                    serde_json::from_str(&json).map_err(|e| unreadable(e.to_string()))?;
                view.version = u64::try_from(version).map_err(|e| unreadable(e.to_string()))?;
                view.leader_heartbeat = Version(
                    u64::try_from(leader_heartbeat).map_err(|e| unreadable(e.to_string()))?,
                );
                Some(view)
            }
        };
        Ok(Some(GroupHead {
            change_counter: u64::try_from(counter).unwrap_or(0),
            view,
        }))
    }

    async fn write_view(
        &self,
        group: &GroupName,
        view: &MembershipView,
        expected: u64,
    ) -> Result<MembershipView, LeaseError> {
        let g = group.to_string();
        let refuse = |why: String| LeaseError::store("write_view", Some(g.clone()), false, why);
        let mut stored = view.clone();
        stored.version = expected + 1;
        let json = serde_json::to_string(&stored).map_err(|e| refuse(e.to_string()))?;
        let at = i64::try_from(expected)
            .map_err(|_| refuse(format!("view version {expected} does not fit a bigint")))?;
        let leader_hb = i64::try_from(stored.leader_heartbeat.0).unwrap_or(i64::MAX);
        let leader = stored.leader.to_string();
        let incarnation = stored.leader_incarnation.to_string();
        let sql = if expected == 0 {
            &self.sql.write_first_view
        } else {
            &self.sql.write_view
        };
        let rows = self
            .query(
                "write_view",
                g.clone(),
                sql,
                &[&g, &at, &json, &leader, &incarnation, &leader_hb],
            )
            .await?;
        if rows.is_empty() {
            let current = self.head(group).await?.and_then(|h| h.view);
            return Err(LeaseError::ViewConflict {
                group: g,
                expected,
                current: current.map(Box::new),
            });
        }
        Ok(stored)
    }

    async fn remove_heartbeat(
        &self,
        group: &GroupName,
        host: &HostName,
        incarnation: &str,
        expected: Version,
    ) -> Result<(), LeaseError> {
        let (g, h, inc) = (group.to_string(), host.to_string(), incarnation.to_string());
        let v = i64::try_from(expected.0).unwrap_or(i64::MAX);
        let rows = self
            .query(
                "remove_heartbeat",
                format!("{group}/{host}"),
                &self.sql.hb_remove,
                &[&g, &h, &v, &inc],
            )
            .await?;
        match rows.first() {
            None => Ok(()),
            Some(row) => {
                let current = parse_heartbeat(group, row, 0)
                    .map_err(|r| malformed_heartbeat(group, host, r))?;
                Err(LeaseError::HeartbeatConflict {
                    group: group.to_string(),
                    host: host.to_string(),
                    current: Some(Box::new(current)),
                })
            }
        }
    }

    async fn membership(&self, group: &GroupName) -> Result<Membership, LeaseError> {
        let g = group.to_string();
        let rows = self
            .query("membership", g.clone(), &self.sql.membership, &[&g])
            .await?;
        let mut m = Membership::default();
        for row in &rows {
            let counter: Option<i64> = row.try_get(5).unwrap_or(None);
            if let Some(c) = counter {
                m.change_counter = u64::try_from(c).unwrap_or(0);
                continue;
            }
            match parse_heartbeat(group, row, 0) {
                Ok(hb) => m.hosts.push(hb),
                // One hand-edited heartbeat row must not blind every host to the others.
                Err(reason) => {
                    tracing::warn!(group = %group, %reason, "skipping malformed heartbeat row")
                }
            }
        }
        m.hosts.sort_by(|a, b| a.host.cmp(&b.host));
        Ok(m)
    }
}
