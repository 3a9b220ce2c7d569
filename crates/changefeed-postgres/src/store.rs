//! [`PostgresLeaseStore`]: the lease store seam on PostgreSQL.
//!
//! It owns the tables `{prefix}_leases`, `{prefix}_heartbeats`, `{prefix}_groups` (the
//! per-group change counter) and `{prefix}_lease_deletions`. Every call but `create` is **one
//! SQL statement**, so one round trip and one implicit transaction: compare-and-swap is
//! `UPDATE … WHERE version = $expected`, and the change counter is bumped by a data-modifying
//! CTE of the same statement exactly when the old row (locked with `SELECT … FOR UPDATE`)
//! differs from the new one in state, owner or next owner. When a CAS matches no row, the same
//! statement reads the current row (`FOR SHARE`, so it is the latest committed one) for the
//! `Conflict`. `create` is `INSERT … ON CONFLICT DO NOTHING` plus the bump, then a second
//! statement stamping the new row (below), in one transaction.
//!
//! # Listing changes
//!
//! [`LeaseStore::list_changes`] reads what changed hands after a counter value in O(changes),
//! from stamps written in the same transaction as the counter bump (schema version 2):
//!
//! - `{prefix}_leases.changed_at`: the counter value at which the row was created or last
//!   changed state, owner or next_owner (a checkpoint keeps it), that is the value its own
//!   write's bump returned. Indexed by `(grp, changed_at)`; the read finds `changed_at > since`
//!   through that index and sorts the few rows by partition. NULL on rows from before the
//!   migration.
//! - `{prefix}_lease_deletions (grp, partition, deleted_at)`: the counter value of the latest
//!   deletion of each key, written by the delete's statement, indexed by `(grp, deleted_at)`.
//!   A key deleted and created again after `since` is listed both as deleted and with its new
//!   row, so a reader that applies the deletions first ends up with the new row.
//! - `{prefix}_groups.changes_from`: the oldest `since` the group can answer; `None` below it
//!   (and above the counter). It starts at the counter as of the migration (older rows carry no
//!   stamp) and rises when deletions are forgotten.
//! - `{prefix}_groups.stamped_counter`: the counter as of the last stamped write. A writer
//!   that moves the counter without stamping (a process of the previous version still running
//!   against migrated tables, a hand edit) leaves it behind: the group then answers `None`
//!   until this store's next counter move, which raises `changes_from` to the counter it found.
//!
//! Deletion records are bounded by a counter horizon, [`DEFAULT_CHANGES_KEPT`] (16,384 moves,
//! as the core's in-memory store; see [`PostgresLeaseStore::changes_kept`]): each delete
//! raises `changes_from` to its own counter value minus that bound and forgets the deletion
//! records at or below it, in the same statement. Every deletion moves the counter, so at most
//! that many records per group remain (and at most one per key), and a host less than that far
//! behind the last delete is answered. Lease rows need no pruning: each holds only its latest
//! stamp.
//!
//! ## Why a reader never sees a counter ahead of its stamps
//!
//! Every counter move takes the group's row lock (`INSERT … ON CONFLICT DO UPDATE`) and holds
//! it to commit, so the writes of one group commit in counter order, and each writes its
//! stamp (or deletion record) in the same transaction as its move, equal to the value the move
//! returned. The read is one statement, so under READ COMMITTED one snapshot: if it shows the
//! counter at `n`, the write that set `n` and every earlier one are committed in it with their
//! stamps, and no later write is visible. Writers lock the lease row before the counter row
//! (the create's second statement only updates the row it inserted), and only deletes touch
//! the deletion records, after the counter row: no lock cycles.

mod members;

use changefeed::lease::HeartbeatRole;
use std::borrow::Cow;
use std::sync::Arc;

use async_trait::async_trait;
use changefeed::lease::row::{SQL_COLUMNS as COLS, SQL_COLUMN_NAMES, SQL_TEXT_COLUMNS};
use changefeed::lease::{BackendError, Changes, LeaseRow, LeaseStore, Listing};
use changefeed::model::{
    GroupHead, GroupName, Heartbeat, HostName, Lease, LeaseKey, Membership, MembershipView,
    PartitionId, Timestamp, Version,
};
use changefeed::LeaseError;
use tokio_postgres::Row;

use crate::db::{table, Db, PgOptions};
use crate::error::PostgresError;

/// The lease store's migrations, in order, for tables with `prefix`. Never edit a released
/// entry; append a new one.
fn migrations(prefix: &str) -> Vec<String> {
    let leases = table(prefix, "leases");
    let heartbeats = table(prefix, "heartbeats");
    let groups = table(prefix, "groups");
    let changed_idx = table(prefix, "leases_changed_at");
    let deletions = table(prefix, "lease_deletions");
    let deleted_idx = table(prefix, "lease_deletions_at");
    vec![
        format!(
            r#"
        CREATE TABLE {leases} (
            grp          text COLLATE "C" NOT NULL,
            partition    text COLLATE "C" NOT NULL,
            state        text NOT NULL,
            owner        text,
            next_owner   text,
            continuation text,
            start        text NOT NULL,
            parents      text NOT NULL,
            properties   text NOT NULL,
            version      bigint NOT NULL,
            PRIMARY KEY (grp, partition)
        );
        CREATE TABLE {heartbeats} (
            grp         text COLLATE "C" NOT NULL,
            host        text COLLATE "C" NOT NULL,
            incarnation text NOT NULL,
            version     bigint NOT NULL,
            written_at  bigint NOT NULL,
            PRIMARY KEY (grp, host)
        );
        CREATE TABLE {groups} (
            grp            text COLLATE "C" PRIMARY KEY,
            change_counter bigint NOT NULL
        );
        "#
        ),
        // 2: change stamps for `list_changes` (see the module docs). Rows from before carry no
        // stamp (NULL), so every group answers only from its counter as of this migration on
        // (`changes_from`); a group with leases but no counter row (only a hand edit makes
        // one) gets counter 1, so a host that saw it at 0 lists in full.
        format!(
            r#"
        ALTER TABLE {leases} ADD COLUMN changed_at bigint;
        CREATE INDEX {changed_idx} ON {leases} (grp, changed_at);
        CREATE TABLE {deletions} (
            grp        text COLLATE "C" NOT NULL,
            partition  text COLLATE "C" NOT NULL,
            deleted_at bigint NOT NULL,
            PRIMARY KEY (grp, partition)
        );
        CREATE INDEX {deleted_idx} ON {deletions} (grp, deleted_at);
        ALTER TABLE {groups} ADD COLUMN changes_from bigint NOT NULL DEFAULT 0;
        ALTER TABLE {groups} ADD COLUMN stamped_counter bigint NOT NULL DEFAULT 0;
        INSERT INTO {groups} (grp, change_counter)
            SELECT DISTINCT grp, 1 FROM {leases} ON CONFLICT (grp) DO NOTHING;
        UPDATE {groups} SET changes_from = change_counter, stamped_counter = change_counter;
        "#
        ),
        // 3: the membership view, in the group's counter row so that one read gives both.
        // `view` is the view as JSON; the leader and its copied heartbeat version are columns,
        // so a leader's renewal updates them in the heartbeat's own statement.
        format!(
            r#"
        ALTER TABLE {groups} ADD COLUMN view_version bigint NOT NULL DEFAULT 0;
        ALTER TABLE {groups} ADD COLUMN view text;
        ALTER TABLE {groups} ADD COLUMN view_leader text;
        ALTER TABLE {groups} ADD COLUMN view_leader_incarnation text;
        ALTER TABLE {groups} ADD COLUMN view_leader_heartbeat bigint NOT NULL DEFAULT 0;
        "#
        ),
        // 4: what a host publishes with its heartbeat (its capacity, limits and loads, JSON),
        // written by each renewal. Rows from before have none.
        format!(
            r#"
        ALTER TABLE {heartbeats} ADD COLUMN report text;
        "#
        ),
    ]
}

/// The schema version of the lease store tables this build creates and understands.
pub const LEASE_SCHEMA_VERSION: i32 = 4;

/// How many change-counter moves back a group's deletions are remembered for
/// [`LeaseStore::list_changes`] by default (see [`PostgresLeaseStore::changes_kept`]): the
/// same bound as the core's in-memory store. A host further behind than that when a lease is
/// deleted gets `None` and lists in full.
pub const DEFAULT_CHANGES_KEPT: u64 = 16_384;

/// How many columns [`COLS`] names.
const COLS_LEN: usize = SQL_TEXT_COLUMNS + 1;

/// The statements, with the table names filled in once.
#[derive(Debug)]
struct Sql {
    list: String,
    get: String,
    create: String,
    create_stamp: String,
    replace: String,
    delete: String,
    hb_create: String,
    hb_renew: String,
    hb_lead: String,
    hb_remove: String,
    head: String,
    write_first_view: String,
    write_view: String,
    membership: String,
    changes: String,
}

impl Sql {
    fn new(prefix: &str) -> Self {
        let leases = table(prefix, "leases");
        let heartbeats = table(prefix, "heartbeats");
        let groups = table(prefix, "groups");
        let deletions = table(prefix, "lease_deletions");
        // Moves the counter (creating the group's row on its first change) and returns the new
        // value, the stamp of the row this statement changes. `stamped_counter` follows it, so
        // a counter moved by a writer that does not stamp shows as the two differing; the
        // next stamped write then raises `changes_from` to the counter it found. `horizon`
        // adds a lower bound for `changes_from` (the delete's pruning bound).
        let bump = |from: &str, cond: &str, horizon: &str| {
            format!(
                "INSERT INTO {groups} AS g (grp, change_counter, stamped_counter)
                 SELECT $1, 1, 1 FROM {from} {cond}
                 ON CONFLICT (grp) DO UPDATE SET change_counter = g.change_counter + 1,
                     stamped_counter = g.change_counter + 1,
                     changes_from = GREATEST(g.changes_from,
                         CASE WHEN g.stamped_counter <> g.change_counter
                              THEN g.change_counter ELSE 0 END{horizon})
                 RETURNING change_counter, changes_from"
            )
        };
        let hb_cols = "host, incarnation, version, written_at, report";
        Sql {
            list: format!("SELECT {COLS} FROM {leases} WHERE grp = $1 ORDER BY partition"),
            get: format!("SELECT {COLS} FROM {leases} WHERE grp = $1 AND partition = $2"),
            create: format!(
                "WITH ins AS (
                    INSERT INTO {leases} (grp, partition, state, owner, next_owner, continuation,
                                          start, parents, properties, version)
                    VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, 1)
                    ON CONFLICT DO NOTHING
                    RETURNING {COLS}
                 ), bump AS ({})
                 SELECT {COLS}, (SELECT change_counter FROM bump) AS changed_at FROM ins",
                bump("ins", "", "")
            ),
            // The second statement of a create, in its transaction: the counter is known only
            // once the insert proved the key new (see `PostgresLeaseStore::create`).
            create_stamp: format!(
                "UPDATE {leases} SET changed_at = $3 WHERE grp = $1 AND partition = $2"
            ),
            replace: format!(
                "WITH old AS (
                    SELECT (state IS DISTINCT FROM $3 OR owner IS DISTINCT FROM $4
                            OR next_owner IS DISTINCT FROM $5) AS moved
                    FROM {leases}
                    WHERE grp = $1 AND partition = $2 AND version = $10
                    FOR UPDATE
                 ), bump AS ({}),
                 upd AS (
                    UPDATE {leases} l SET state = $3, owner = $4, next_owner = $5,
                        continuation = $6, start = $7, parents = $8, properties = $9,
                        version = l.version + 1,
                        changed_at = COALESCE((SELECT change_counter FROM bump), l.changed_at)
                    FROM old WHERE l.grp = $1 AND l.partition = $2
                    RETURNING l.partition, l.state, l.owner, l.next_owner, l.continuation,
                        l.start, l.parents, l.properties, l.version
                 ),
                 cur AS (
                    SELECT {COLS} FROM {leases}
                    WHERE grp = $1 AND partition = $2 AND NOT EXISTS (SELECT 1 FROM upd)
                    FOR SHARE
                 )
                 SELECT true AS written, {COLS} FROM upd
                 UNION ALL SELECT false, {COLS} FROM cur",
                bump("old", "WHERE old.moved", "")
            ),
            delete: format!(
                "WITH del AS (
                    DELETE FROM {leases} WHERE grp = $1 AND partition = $2 AND version = $3
                    RETURNING 1
                 ), bump AS ({}),
                 rec AS (
                    INSERT INTO {deletions} (grp, partition, deleted_at)
                    SELECT $1, $2, change_counter FROM bump
                    ON CONFLICT (grp, partition) DO UPDATE SET deleted_at = EXCLUDED.deleted_at
                 ), prune AS (
                    DELETE FROM {deletions}
                    WHERE grp = $1 AND partition <> $2
                      AND deleted_at <= (SELECT changes_from FROM bump)
                 ),
                 cur AS (
                    SELECT {COLS} FROM {leases}
                    WHERE grp = $1 AND partition = $2 AND NOT EXISTS (SELECT 1 FROM del)
                    FOR SHARE
                 )
                 SELECT EXISTS (SELECT 1 FROM del) AS deleted, cur.*
                 FROM (SELECT 1) AS one LEFT JOIN cur ON true",
                bump("del", "", ", g.change_counter + 1 - $4")
            ),
            hb_create: format!(
                "WITH ins AS (
                    INSERT INTO {heartbeats} (grp, host, incarnation, version, written_at, report)
                    VALUES ($1, $2, $3, 1, $4, $5)
                    ON CONFLICT DO NOTHING
                    RETURNING {hb_cols}
                 ), cur AS (
                    SELECT {hb_cols} FROM {heartbeats}
                    WHERE grp = $1 AND host = $2 AND NOT EXISTS (SELECT 1 FROM ins)
                    FOR SHARE
                 )
                 SELECT true AS written, {hb_cols} FROM ins
                 UNION ALL SELECT false, {hb_cols} FROM cur"
            ),
            hb_renew: format!(
                "WITH upd AS (
                    UPDATE {heartbeats} SET incarnation = $3, written_at = $4,
                        version = version + 1, report = $6
                    WHERE grp = $1 AND host = $2 AND version = $5
                    RETURNING {hb_cols}
                 ), cur AS (
                    SELECT {hb_cols} FROM {heartbeats}
                    WHERE grp = $1 AND host = $2 AND NOT EXISTS (SELECT 1 FROM upd)
                    FOR SHARE
                 )
                 SELECT true AS written, {hb_cols} FROM upd
                 UNION ALL SELECT false, {hb_cols} FROM cur"
            ),
            // A renewal that also copies its version into the view this host leads: one
            // statement, so one atomic step.
            hb_lead: format!(
                "WITH upd AS (
                    UPDATE {heartbeats} SET incarnation = $3, written_at = $4,
                        version = version + 1, report = $6
                    WHERE grp = $1 AND host = $2 AND version = $5
                    RETURNING {hb_cols}
                 ), lead AS (
                    UPDATE {groups} SET view_leader_heartbeat = (SELECT version FROM upd)
                    WHERE grp = $1 AND view_leader = $2 AND view_leader_incarnation = $3
                      AND EXISTS (SELECT 1 FROM upd)
                 ), cur AS (
                    SELECT {hb_cols} FROM {heartbeats}
                    WHERE grp = $1 AND host = $2 AND NOT EXISTS (SELECT 1 FROM upd)
                    FOR SHARE
                 )
                 SELECT true AS written, {hb_cols} FROM upd
                 UNION ALL SELECT false, {hb_cols} FROM cur"
            ),
            head: format!(
                "SELECT change_counter, view_version, view, view_leader_heartbeat
                 FROM {groups} WHERE grp = $1"
            ),
            // The first view ($2 = 0): the group's row may not exist yet. No row back: a view
            // was written meanwhile.
            write_first_view: format!(
                "INSERT INTO {groups} AS g (grp, change_counter, view_version, view, view_leader,
                    view_leader_incarnation, view_leader_heartbeat)
                 VALUES ($1, 0, $2::bigint + 1, $3, $4, $5, $6::bigint)
                 ON CONFLICT (grp) DO UPDATE SET view_version = $2::bigint + 1, view = $3,
                    view_leader = $4, view_leader_incarnation = $5,
                    view_leader_heartbeat = $6::bigint
                 WHERE g.view_version = $2::bigint
                 RETURNING 1"
            ),
            // A later view, only at the expected version ($2). No row back: it had moved.
            write_view: format!(
                "UPDATE {groups} SET view_version = $2::bigint + 1, view = $3, view_leader = $4,
                    view_leader_incarnation = $5, view_leader_heartbeat = $6::bigint
                 WHERE grp = $1 AND view_version = $2::bigint
                 RETURNING 1"
            ),
            hb_remove: format!(
                "WITH del AS (
                    DELETE FROM {heartbeats}
                    WHERE grp = $1 AND host = $2 AND version = $3 AND incarnation = $4
                    RETURNING 1
                 ), cur AS (
                    SELECT {hb_cols} FROM {heartbeats}
                    WHERE grp = $1 AND host = $2 AND NOT EXISTS (SELECT 1 FROM del)
                    FOR SHARE
                 )
                 SELECT {hb_cols} FROM cur"
            ),
            membership: format!(
                "SELECT host, incarnation, version, written_at, report, NULL::bigint AS counter
                 FROM {heartbeats} WHERE grp = $1
                 UNION ALL
                 SELECT NULL, NULL, NULL, NULL, NULL, change_counter FROM {groups} WHERE grp = $1"
            ),
            // One statement, so one snapshot: the counter row and the rows stamped up to it.
            // The first row (kind 0) is the group's counters; then (kind 1) the leases stamped
            // after $2 and (kind 2) the keys deleted after it, read only when $2 can be
            // answered, so a refused read costs one row.
            changes: format!(
                "WITH g AS (
                    SELECT COALESCE(max(change_counter), 0) AS counter,
                           COALESCE(max(changes_from), 0) AS changes_from,
                           COALESCE(max(stamped_counter), 0) AS stamped
                    FROM {groups} WHERE grp = $1
                 ), ok AS (
                    SELECT 1 FROM g
                    WHERE $2 >= g.changes_from AND $2 <= g.counter AND g.stamped = g.counter
                 )
                 SELECT 0 AS kind, counter, changes_from, stamped,
                        NULL::text COLLATE \"C\" AS partition, NULL::text, NULL::text,
                        NULL::text, NULL::text, NULL::text, NULL::text, NULL::text,
                        NULL::bigint
                 FROM g
                 UNION ALL
                 SELECT 1, NULL, NULL, NULL, {COLS} FROM {leases}
                 WHERE grp = $1 AND changed_at > $2 AND EXISTS (SELECT 1 FROM ok)
                 UNION ALL
                 SELECT 2, NULL, NULL, NULL, partition, NULL, NULL, NULL, NULL, NULL, NULL,
                        NULL, NULL
                 FROM {deletions}
                 WHERE grp = $1 AND deleted_at > $2 AND EXISTS (SELECT 1 FROM ok)
                 ORDER BY kind, partition"
            ),
        }
    }
}

/// A [`LeaseStore`] in PostgreSQL.
///
/// [`Clone`] shares the connection pool; [`PostgresLeaseStore::connect`] called again opens
/// another pool. Every call is one statement (`create`: two, in one transaction) on a pooled
/// connection, bounded by the
/// server-side `statement_timeout` and a client-side timeout (see [`PgOptions`]); both
/// surface as retryable [`LeaseError::Store`] errors.
///
/// It answers [`LeaseStore::list_changes`] in one statement reading O(changes) rows: each
/// lease row carries the counter value at which it last changed hands (`changed_at`), and each
/// delete records its key and counter value in `{prefix}_lease_deletions`, kept for
/// [`PostgresLeaseStore::changes_kept`] counter moves. Counters below the group's value at the
/// migration to schema version 2 are answered `None`.
#[derive(Debug, Clone)]
pub struct PostgresLeaseStore {
    db: Db,
    sql: std::sync::Arc<Sql>,
    /// [`PostgresLeaseStore::changes_kept`], as the bigint the delete statement takes.
    changes_kept: i64,
}

impl PostgresLeaseStore {
    /// Connects with default [`PgOptions`] for `url` and brings the schema up to date.
    ///
    /// # Errors
    /// As for [`PostgresLeaseStore::connect_with`].
    pub async fn connect(url: &str) -> Result<Self, LeaseError> {
        Self::connect_with(PgOptions::new(url)).await
    }

    /// Connects with `options` and brings the lease tables up to date (creating them on first
    /// use; concurrent starters are serialised by an advisory lock).
    ///
    /// # Errors
    /// [`LeaseError::Store`] (operation `connect`) for a bad setting
    /// ([`PostgresError::Config`]), an unreachable server (retryable), or tables written by a
    /// newer build ([`PostgresError::SchemaTooNew`]).
    pub async fn connect_with(options: PgOptions) -> Result<Self, LeaseError> {
        let fail = |e: PostgresError| e.into_lease("connect", None);
        let db = Db::new(&options).map_err(fail)?;
        db.migrate("lease_store", &migrations(db.prefix()))
            .await
            .map_err(fail)?;
        let sql = std::sync::Arc::new(Sql::new(db.prefix()));
        Ok(Self {
            db,
            sql,
            changes_kept: i64::try_from(DEFAULT_CHANGES_KEPT).unwrap_or(i64::MAX),
        })
    }

    /// How many change-counter moves back this handle's deletes keep deletion records
    /// (default [`DEFAULT_CHANGES_KEPT`]): each delete forgets those more than `moves` counter
    /// moves older than itself and raises the group's `changes_from` to match, so
    /// [`LeaseStore::list_changes`] answers `None` for a counter further back (the host then
    /// lists in full). A group keeps at most `moves` deletion records. Handles with different
    /// settings may share the tables: every reader checks the bound recorded in the group's
    /// row, not its own setting.
    pub fn changes_kept(mut self, moves: u64) -> Self {
        self.changes_kept = i64::try_from(moves).unwrap_or(i64::MAX);
        self
    }

    /// The table prefix.
    pub fn prefix(&self) -> &str {
        self.db.prefix()
    }

    /// The version of the lease row under `key` as stored, whether or not the rest of it can
    /// be read; `None` if there is no row. For repairing a malformed row (`changefeed reset
    /// --force`): [`LeaseStore::delete`] removes it at this version.
    ///
    /// # Errors
    /// [`LeaseError::Store`] if the query fails.
    pub async fn row_version(&self, key: &LeaseKey) -> Result<Option<Version>, LeaseError> {
        let sql = format!(
            "SELECT version FROM {} WHERE grp = $1 AND partition = $2",
            table(self.db.prefix(), "leases")
        );
        let rows = self
            .query(
                "get",
                key.to_string(),
                &sql,
                &[&key.group.as_str(), &key.partition.as_str()],
            )
            .await?;
        let Some(row) = rows.first() else {
            return Ok(None);
        };
        let version: i64 = col(row, 0, "version").map_err(|reason| LeaseError::Malformed {
            key: key.to_string(),
            reason,
        })?;
        u64::try_from(version)
            .map(|v| Some(Version(v)))
            .map_err(|_| LeaseError::Malformed {
                key: key.to_string(),
                reason: format!("version: {version} is negative"),
            })
    }

    /// A heartbeat write; with `lead`, a renewal also copies its version into the view this
    /// host leads, in the same statement.
    #[allow(clippy::too_many_arguments)]
    async fn write_heartbeat(
        &self,
        group: &GroupName,
        host: &HostName,
        incarnation: &str,
        written_at: Timestamp,
        expected: Option<Version>,
        lead: bool,
        report: Option<&str>,
    ) -> Result<Heartbeat, LeaseError> {
        let (g, h) = (group.to_string(), host.to_string());
        let at = written_at.millis();
        let inc = incarnation.to_string();
        let key = format!("{group}/{host}");
        let rows = match expected {
            None => {
                self.query(
                    "heartbeat",
                    key,
                    &self.sql.hb_create,
                    &[&g, &h, &inc, &at, &report],
                )
                .await?
            }
            Some(v) => {
                let v = i64::try_from(v.0).unwrap_or(i64::MAX);
                let sql = if lead {
                    &self.sql.hb_lead
                } else {
                    &self.sql.hb_renew
                };
                self.query("heartbeat", key, sql, &[&g, &h, &inc, &at, &v, &report])
                    .await?
            }
        };
        let conflict = |current: Option<Heartbeat>| LeaseError::HeartbeatConflict {
            group: group.to_string(),
            host: host.to_string(),
            current: current.map(Box::new),
        };
        let Some(row) = rows.first() else {
            return Err(conflict(None));
        };
        let written: bool = row.try_get(0).map_err(|e| {
            PostgresError::from(e).into_lease("heartbeat", Some(format!("{group}/{host}")))
        })?;
        let current =
            parse_heartbeat(group, row, 1).map_err(|r| malformed_heartbeat(group, host, r))?;
        if written {
            Ok(current)
        } else {
            Err(conflict(Some(current)))
        }
    }

    async fn query(
        &self,
        operation: &'static str,
        key: String,
        sql: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> Result<Vec<Row>, LeaseError> {
        self.db
            .run(operation, |client| async move {
                let stmt = client.prepare_cached(sql).await?;
                Ok(client.query(&stmt, params).await?)
            })
            .await
            .map_err(|e| e.into_lease(operation, Some(key)))
    }
}

/// A statement parameter.
type Param<'a> = &'a (dyn tokio_postgres::types::ToSql + Sync);

/// A lease encoded for writing.
struct Encoded {
    group: String,
    row: LeaseRow,
}

impl Encoded {
    fn new(lease: &Lease) -> Result<Self, LeaseError> {
        Ok(Self {
            group: lease.key.group.to_string(),
            row: LeaseRow::encode(lease)?,
        })
    }

    /// The lease as statement parameters: `$1` the group, then `$2`…`$9` the text columns of
    /// [`COLS`] (the version aside), from `text`, the row's [`LeaseRow::sql_text`].
    fn params<'a>(&'a self, text: &'a [Option<Cow<'a, str>>]) -> Vec<Param<'a>> {
        std::iter::once(&self.group as Param<'a>)
            .chain(text.iter().map(|t| t as Param<'a>))
            .collect()
    }
}

fn to_sql_version(v: Version, key: &LeaseKey) -> Result<i64, LeaseError> {
    i64::try_from(v.0).map_err(|_| {
        LeaseError::store(
            "write",
            Some(key.to_string()),
            false,
            format!("version {v} does not fit PostgreSQL's bigint"),
        )
    })
}

fn col<'r, T: tokio_postgres::types::FromSql<'r>>(
    row: &'r Row,
    i: usize,
    name: &str,
) -> Result<T, String> {
    row.try_get(i).map_err(|e| format!("{name}: {e}"))
}

/// Reads a lease row (columns from `offset` on, in [`COLS`] order), or a
/// [`LeaseError::Malformed`] naming its key and what is wrong.
fn parse_lease(group: &GroupName, row: &Row, offset: usize) -> Result<Lease, LeaseError> {
    let raw_partition: Option<&str> = row.try_get(offset).ok().flatten();
    let parse = || -> Result<Lease, String> {
        let mut text = [None; SQL_TEXT_COLUMNS];
        for (i, value) in text.iter_mut().enumerate() {
            *value = col(row, offset + i, SQL_COLUMN_NAMES[i])?;
        }
        let version: i64 = col(row, offset + SQL_TEXT_COLUMNS, "version")?;
        if version < 1 {
            return Err(format!("version must be positive, found {version}"));
        }
        LeaseRow::from_sql_text(text, version as u64)?.decode(group)
    };
    parse().map_err(|reason| LeaseError::Malformed {
        key: format!("{group}/{}", raw_partition.unwrap_or("<null>")),
        reason,
    })
}

fn parse_heartbeat(group: &GroupName, row: &Row, offset: usize) -> Result<Heartbeat, String> {
    let host: String = col(row, offset, "host")?;
    let host = HostName::new(host).map_err(|e| e.to_string())?;
    let version: i64 = col(row, offset + 2, "version")?;
    if version < 1 {
        return Err(format!("heartbeat {host}: version must be positive"));
    }
    Ok(Heartbeat {
        group: group.clone(),
        host,
        incarnation: col::<String>(row, offset + 1, "incarnation")?.into(),
        version: Version(version as u64),
        written_at: Timestamp(col(row, offset + 3, "written_at")?),
        report: col::<Option<String>>(row, offset + 4, "report")?.map(Into::into),
    })
}

fn malformed_heartbeat(group: &GroupName, host: &HostName, reason: String) -> LeaseError {
    PostgresError::MalformedRow {
        table: "heartbeats",
        key: format!("{group}/{host}"),
        reason,
    }
    .into_lease("heartbeat", Some(format!("{group}/{host}")))
}

#[async_trait]
impl LeaseStore for PostgresLeaseStore {
    async fn list(&self, group: &GroupName) -> Result<Listing, LeaseError> {
        let g = group.to_string();
        let rows = self.query("list", g.clone(), &self.sql.list, &[&g]).await?;
        let mut listing = Listing::default();
        listing.leases.reserve(rows.len());
        for row in &rows {
            match parse_lease(group, row, 0) {
                Ok(l) => listing.leases.push(Arc::new(l)),
                Err(e) => listing.malformed.push(e),
            }
        }
        Ok(listing)
    }

    async fn get(&self, key: &LeaseKey) -> Result<Option<Lease>, LeaseError> {
        let (g, p) = (key.group.to_string(), key.partition.to_string());
        let rows = self
            .query("get", key.to_string(), &self.sql.get, &[&g, &p])
            .await?;
        rows.first()
            .map(|r| parse_lease(&key.group, r, 0))
            .transpose()
    }

    async fn create(&self, lease: &Lease) -> Result<Option<Lease>, LeaseError> {
        // Two statements in one transaction: the insert moves the counter only if it created
        // the row (so the counter value is known only after it), and the second stamps the
        // new row with that value. The lease row is locked before the counter row, as in
        // `replace` and `delete`, so writers never wait on each other in a cycle.
        let e = Encoded::new(lease)?;
        let text = e.row.sql_text();
        let (params, group, partition) = (e.params(&text), &e.group, &e.row.partition);
        let sql = &self.sql;
        let rows = self
            .db
            .run("create", |mut client| async move {
                let tx = client.transaction().await?;
                let insert = tx.prepare_cached(&sql.create).await?;
                let rows = tx.query(&insert, &params).await?;
                if let Some(row) = rows.first() {
                    let counter: i64 = row.try_get(COLS_LEN)?;
                    let stamp = tx.prepare_cached(&sql.create_stamp).await?;
                    tx.execute(&stamp, &[group, partition, &counter]).await?;
                }
                tx.commit().await?;
                Ok(rows)
            })
            .await
            .map_err(|err| err.into_lease("create", Some(lease.key.to_string())))?;
        rows.first()
            .map(|r| parse_lease(&lease.key.group, r, 0))
            .transpose()
    }

    async fn replace(&self, lease: &Lease, expected: Version) -> Result<Lease, LeaseError> {
        let e = Encoded::new(lease)?;
        let v = to_sql_version(expected, &lease.key)?;
        let text = e.row.sql_text();
        let mut params = e.params(&text);
        params.push(&v);
        let rows = self
            .query("replace", lease.key.to_string(), &self.sql.replace, &params)
            .await?;
        let Some(row) = rows.first() else {
            return Err(LeaseError::NotFound {
                key: lease.key.to_string(),
            });
        };
        let written: bool = row.try_get(0).map_err(|err| {
            PostgresError::from(err).into_lease("replace", Some(lease.key.to_string()))
        })?;
        let current = parse_lease(&lease.key.group, row, 1)?;
        if written {
            Ok(current)
        } else {
            Err(LeaseError::Conflict {
                key: lease.key.to_string(),
                expected,
                current: Box::new(current),
            })
        }
    }

    async fn delete(&self, key: &LeaseKey, expected: Version) -> Result<(), LeaseError> {
        let (g, p) = (key.group.to_string(), key.partition.to_string());
        let v = to_sql_version(expected, key)?;
        let rows = self
            .query(
                "delete",
                key.to_string(),
                &self.sql.delete,
                &[&g, &p, &v, &self.changes_kept],
            )
            .await?;
        let Some(row) = rows.first() else {
            return Err(LeaseError::NotFound {
                key: key.to_string(),
            });
        };
        let to_err = |err: tokio_postgres::Error| {
            PostgresError::from(err).into_lease("delete", Some(key.to_string()))
        };
        let deleted: bool = row.try_get(0).map_err(to_err)?;
        if deleted {
            return Ok(());
        }
        let present: Option<String> = row.try_get(1).map_err(to_err)?;
        if present.is_none() {
            return Err(LeaseError::NotFound {
                key: key.to_string(),
            });
        }
        let current = parse_lease(&key.group, row, 1)?;
        Err(LeaseError::Conflict {
            key: key.to_string(),
            expected,
            current: Box::new(current),
        })
    }

    async fn list_changes(
        &self,
        group: &GroupName,
        since: u64,
    ) -> Result<Option<Changes>, LeaseError> {
        let Ok(since_sql) = i64::try_from(since) else {
            // No counter reaches past bigint: this one has not been reached.
            return Ok(None);
        };
        let g = group.to_string();
        let rows = self
            .query(
                "list_changes",
                g.clone(),
                &self.sql.changes,
                &[&g, &since_sql],
            )
            .await?;
        let bad_group = |reason: String| {
            PostgresError::MalformedRow {
                table: "groups",
                key: g.clone(),
                reason,
            }
            .into_lease("list_changes", Some(g.clone()))
        };
        let Some((head, rest)) = rows.split_first() else {
            return Err(bad_group("the read returned no counter row".into()));
        };
        let counter_col = |i: usize, name: &str| -> Result<u64, LeaseError> {
            let value: i64 = col(head, i, name).map_err(&bad_group)?;
            u64::try_from(value)
                .map_err(|_| bad_group(format!("{name} must not be negative, found {value}")))
        };
        let counter = counter_col(1, "change_counter")?;
        let changes_from = counter_col(2, "changes_from")?;
        let stamped = counter_col(3, "stamped_counter")?;
        // The same test as the statement's: below `changes_from` the rows carry no reliable
        // stamp or the deletions are forgotten; above the counter is a value not reached yet;
        // `stamped != counter` means a writer moved the counter without stamping.
        if since < changes_from || since > counter || stamped != counter {
            return Ok(None);
        }
        let mut changes = Changes {
            counter,
            ..Changes::default()
        };
        for row in rest {
            let kind: i32 = col(row, 0, "kind").map_err(&bad_group)?;
            match kind {
                1 => match parse_lease(group, row, 4) {
                    Ok(lease) => changes.leases.push(Arc::new(lease)),
                    Err(e) => changes.malformed.push(e),
                },
                2 => {
                    let partition: Option<String> = row.try_get(4).ok().flatten();
                    let shown = partition.clone().unwrap_or_else(|| "<null>".into());
                    match PartitionId::new(partition.unwrap_or_default()) {
                        Ok(p) => changes.deleted.push(LeaseKey::new(group.clone(), p)),
                        Err(e) => changes.malformed.push(LeaseError::Malformed {
                            key: format!("{group}/{shown}"),
                            reason: format!("deletion record: {e}"),
                        }),
                    }
                }
                other => return Err(bad_group(format!("unexpected row kind {other}"))),
            }
        }
        Ok(Some(changes))
    }
}
