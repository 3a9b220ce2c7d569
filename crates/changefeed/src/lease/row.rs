//! [`LeaseRow`]: the lease row codec, a [`Lease`] as the plain values a backend stores, and
//! back.
//!
//! Every backend stores a lease's fields the same way, and this module is where that is
//! written down, once:
//!
//! | field | stored as |
//! |---|---|
//! | partition | its id, as text |
//! | state | `available`, `owned` or `finished` |
//! | owner, next owner | the host name; absent (NULL) when unset |
//! | continuation | the source's token; absent (NULL) until the first checkpoint |
//! | start | the [`Position`]'s text: `beginning`, `now`, `at:MILLIS`, `after:TOKEN` |
//! | parents | a list of partition ids (SQL stores: a JSON array of strings in one column) |
//! | properties | a JSON object of strings |
//! | version | a positive integer |
//!
//! A backend binds a [`LeaseRow`]'s values to its own column or attribute types, and reads
//! them back into one for [`LeaseRow::decode`], which checks them and says what is wrong with a
//! row that breaks a rule. The group is not in the row: each backend keys it its own way, and
//! names an unreadable row by its key as stored. SQL stores keep the fields in the columns
//! [`SQL_COLUMNS`], eight of text and the version, bound and read through
//! [`LeaseRow::sql_text`] and [`LeaseRow::from_sql_text`].

use std::borrow::Cow;
use std::collections::BTreeMap;

use crate::error::ModelError;
use crate::model::{
    Continuation, GroupName, HostName, Lease, LeaseKey, LeaseState, PartitionId, Position, Version,
};

/// The lease columns of SQL stores (the group's column aside), in the order of
/// [`SQL_COLUMN_NAMES`]: the [`SQL_TEXT_COLUMNS`] text columns, then `version`.
pub const SQL_COLUMNS: &str =
    "partition, state, owner, next_owner, continuation, start, parents, properties, version";

/// The names of [`SQL_COLUMNS`], one by one.
pub const SQL_COLUMN_NAMES: [&str; SQL_TEXT_COLUMNS + 1] = [
    "partition",
    "state",
    "owner",
    "next_owner",
    "continuation",
    "start",
    "parents",
    "properties",
    "version",
];

/// How many of [`SQL_COLUMNS`] hold text: all but the version, the last.
pub const SQL_TEXT_COLUMNS: usize = 8;

/// A lease's fields as the plain values a backend stores (the group aside); see the module
/// docs for the format.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseRow {
    /// The partition id.
    pub partition: String,
    /// `available`, `owned` or `finished`.
    pub state: String,
    /// The owner's host name.
    pub owner: Option<String>,
    /// The host name of the host the lease is being handed to.
    pub next_owner: Option<String>,
    /// The continuation token.
    pub continuation: Option<String>,
    /// The start position's text.
    pub start: String,
    /// The parents' partition ids, in order.
    pub parents: Vec<String>,
    /// The properties as a JSON object of strings.
    pub properties: String,
    /// The row version. Stores write their own (the next one) rather than the lease's.
    pub version: u64,
}

impl LeaseRow {
    /// The values to store for `lease`.
    ///
    /// # Errors
    /// [`ModelError::InconsistentLease`] if `lease` fails [`Lease::validate`]: a store never
    /// writes a lease it could not read back.
    pub fn encode(lease: &Lease) -> Result<Self, ModelError> {
        lease.validate()?;
        Ok(Self {
            partition: lease.key.partition.to_string(),
            state: lease.state.as_str().to_string(),
            owner: lease.owner.as_ref().map(HostName::to_string),
            next_owner: lease.next_owner.as_ref().map(HostName::to_string),
            continuation: lease.continuation.as_ref().map(Continuation::to_string),
            start: lease.start.to_string(),
            parents: lease.parents.iter().map(PartitionId::to_string).collect(),
            properties: serde_json::to_string(&lease.properties)
                .expect("a map of strings always encodes as JSON"),
            version: lease.version.0,
        })
    }

    /// The lease of `group` these values stand for.
    ///
    /// # Errors
    /// Why the values are not a lease (an invalid partition id or host name, an unknown state
    /// or position, properties that are not a JSON object of strings, a lease that fails
    /// [`Lease::validate`]), for the backend to report as [`crate::LeaseError::Malformed`]
    /// under the row's key.
    pub fn decode(self, group: &GroupName) -> Result<Lease, String> {
        let partition = PartitionId::new(self.partition).map_err(|e| e.to_string())?;
        let state: LeaseState = self.state.parse().map_err(|e: ModelError| e.to_string())?;
        let host = |h: Option<String>, name: &str| {
            h.map(|h| HostName::new(h).map_err(|e| format!("{name}: {e}")))
                .transpose()
        };
        let owner = host(self.owner, "owner")?;
        let next_owner = host(self.next_owner, "next_owner")?;
        let start: Position = self
            .start
            .parse()
            .map_err(|e: ModelError| format!("start: {e}"))?;
        let parents = self
            .parents
            .into_iter()
            .map(|p| PartitionId::new(p).map_err(|e| format!("parents: {e}")))
            .collect::<Result<_, _>>()?;
        let properties: BTreeMap<String, String> = serde_json::from_str(&self.properties)
            .map_err(|e| format!("properties is not a JSON object of strings: {e}"))?;
        let lease = Lease {
            key: LeaseKey::new(group.clone(), partition),
            state,
            owner,
            next_owner,
            continuation: self.continuation.map(Continuation::new),
            start,
            parents,
            properties,
            version: Version(self.version),
        };
        lease.validate().map_err(|e| e.to_string())?;
        Ok(lease)
    }

    /// The text columns of SQL stores, in [`SQL_COLUMNS`] order (the version aside), `None`
    /// for NULL: the parents as a JSON array of strings, the others as they are.
    pub fn sql_text(&self) -> [Option<Cow<'_, str>>; SQL_TEXT_COLUMNS] {
        fn text(s: &str) -> Option<Cow<'_, str>> {
            Some(Cow::Borrowed(s))
        }
        fn nullable(s: &Option<String>) -> Option<Cow<'_, str>> {
            s.as_deref().map(Cow::Borrowed)
        }
        [
            text(&self.partition),
            text(&self.state),
            nullable(&self.owner),
            nullable(&self.next_owner),
            nullable(&self.continuation),
            text(&self.start),
            Some(Cow::Owned(self.parents_json())),
            text(&self.properties),
        ]
    }

    /// The row an SQL store read: `text`, its text columns in [`SQL_COLUMNS`] order (`None`
    /// for NULL), and the version.
    ///
    /// # Errors
    /// A column that must not be NULL and is, or parents that are not a JSON array of strings.
    pub fn from_sql_text(
        text: [Option<&str>; SQL_TEXT_COLUMNS],
        version: u64,
    ) -> Result<Self, String> {
        let [partition, state, owner, next_owner, continuation, start, parents, properties] = text;
        let required = |value: Option<&str>, i: usize| {
            value
                .map(str::to_string)
                .ok_or_else(|| format!("{} is NULL", SQL_COLUMN_NAMES[i]))
        };
        Ok(Self {
            partition: required(partition, 0)?,
            state: required(state, 1)?,
            owner: owner.map(str::to_string),
            next_owner: next_owner.map(str::to_string),
            continuation: continuation.map(str::to_string),
            start: required(start, 5)?,
            parents: Self::parents_from_json(&required(parents, 6)?)?,
            properties: required(properties, 7)?,
            version,
        })
    }

    /// The parents as SQL stores keep them: a JSON array of strings.
    pub fn parents_json(&self) -> String {
        serde_json::to_string(&self.parents).expect("a list of strings always encodes as JSON")
    }

    /// Reads parents stored by [`LeaseRow::parents_json`].
    ///
    /// # Errors
    /// Why `json` is not a JSON array of strings.
    pub fn parents_from_json(json: &str) -> Result<Vec<String>, String> {
        serde_json::from_str(json)
            .map_err(|e| format!("parents is not a JSON array of partition ids: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn group() -> GroupName {
        GroupName::new("orders").expect("valid")
    }

    fn full_lease() -> Lease {
        let key = LeaseKey::new(group(), PartitionId::new("shard-7").expect("valid"));
        let mut lease = Lease::new(key, Position::AtTime(crate::model::Timestamp(1_700)))
            .with_parents(vec![
                PartitionId::new("shard-1").expect("valid"),
                PartitionId::new("sh\"ard-2").expect("valid"),
            ]);
        lease.state = LeaseState::Owned;
        lease.owner = Some(HostName::new("host-a").expect("valid"));
        lease.next_owner = Some(HostName::new("hôst-b").expect("valid"));
        lease.continuation = Some(Continuation::new("shard-7:42"));
        lease.properties.insert("weight".into(), "3".into());
        lease
            .properties
            .insert("ключ".into(), "значение \"q\"".into());
        lease.version = Version(9);
        lease
    }

    #[test]
    fn a_lease_is_stored_in_the_documented_format() {
        // The stored values are the on-disk format every backend has always written: any
        // change here breaks existing lease tables.
        let row = LeaseRow::encode(&full_lease()).expect("valid lease");
        assert_eq!(
            row,
            LeaseRow {
                partition: "shard-7".into(),
                state: "owned".into(),
                owner: Some("host-a".into()),
                next_owner: Some("hôst-b".into()),
                continuation: Some("shard-7:42".into()),
                start: "at:1700".into(),
                parents: vec!["shard-1".into(), "sh\"ard-2".into()],
                properties: r#"{"weight":"3","ключ":"значение \"q\""}"#.into(),
                version: 9,
            }
        );
        assert_eq!(row.parents_json(), r#"["shard-1","sh\"ard-2"]"#);
        let empty = LeaseRow::encode(&Lease::new(
            LeaseKey::new(group(), PartitionId::new("0").expect("valid")),
            Position::Beginning,
        ))
        .expect("valid lease");
        assert_eq!(
            (
                empty.state.as_str(),
                empty.owner.as_deref(),
                empty.start.as_str()
            ),
            ("available", None, "beginning")
        );
        assert_eq!(
            (empty.properties.as_str(), empty.parents_json()),
            ("{}", "[]".into())
        );
    }

    #[test]
    fn every_field_round_trips() {
        // What a store writes it reads back unchanged, through the columns of SQL stores too.
        let lease = full_lease();
        let row = LeaseRow::encode(&lease).expect("valid lease");
        let text = row.sql_text();
        let read = LeaseRow::from_sql_text(text.each_ref().map(|t| t.as_deref()), row.version)
            .expect("our columns");
        assert_eq!(read, row);
        assert_eq!(read.decode(&group()).expect("readable"), lease);
        assert_eq!(SQL_COLUMNS, SQL_COLUMN_NAMES.join(", "));
    }

    #[test]
    fn sql_columns_hold_text_and_null_only_where_optional() {
        // The SQL columns are the documented format: parents as a JSON array, unset as NULL.
        let mut lease = full_lease();
        lease.state = LeaseState::Available;
        lease.owner = None;
        lease.next_owner = None;
        lease.continuation = None;
        let row = LeaseRow::encode(&lease).expect("valid lease");
        let text = row.sql_text();
        let text: Vec<Option<&str>> = text.iter().map(|t| t.as_deref()).collect();
        assert_eq!(
            text,
            [
                Some("shard-7"),
                Some("available"),
                None,
                None,
                None,
                Some("at:1700"),
                Some(r#"["shard-1","sh\"ard-2"]"#),
                Some(r#"{"weight":"3","ключ":"значение \"q\""}"#),
            ]
        );
        let mut missing = [
            Some("p"),
            None,
            None,
            None,
            None,
            Some("now"),
            Some("[]"),
            Some("{}"),
        ];
        let err = LeaseRow::from_sql_text(missing, 1).expect_err("no state");
        assert_eq!(err, "state is NULL");
        missing[1] = Some("available");
        missing[6] = Some("{}");
        let err = LeaseRow::from_sql_text(missing, 1).expect_err("parents not a list");
        assert!(err.starts_with("parents is not a JSON array"), "{err}");
    }

    #[test]
    fn an_inconsistent_lease_is_never_encoded() {
        // A store refuses to write what it could not read back.
        let mut lease = full_lease();
        lease.owner = None;
        assert!(matches!(
            LeaseRow::encode(&lease),
            Err(ModelError::InconsistentLease { .. })
        ));
    }

    #[test]
    fn unreadable_values_say_which_field_is_wrong() {
        // A malformed row is reported with what is wrong, so an operator can repair it.
        let good = LeaseRow::encode(&full_lease()).expect("valid lease");
        let reason = |edit: fn(&mut LeaseRow)| {
            let mut row = good.clone();
            edit(&mut row);
            row.decode(&group()).expect_err("malformed")
        };
        assert!(reason(|r| r.state = "lost".into()).contains("lease state"));
        assert!(reason(|r| r.owner = Some(" x".into())).starts_with("owner: "));
        assert!(reason(|r| r.next_owner = Some(String::new())).starts_with("next_owner: "));
        assert!(reason(|r| r.start = "later".into()).starts_with("start: "));
        assert!(reason(|r| r.parents = vec![String::new()]).starts_with("parents: "));
        assert!(reason(|r| r.properties = "{oops".into()).starts_with("properties "));
        assert!(reason(|r| r.partition = String::new()).contains("partition id"));
        assert!(reason(|r| r.owner = None).contains("must have an owner"));
        let err = LeaseRow::parents_from_json("[1]").expect_err("not strings");
        assert!(err.starts_with("parents "), "{err}");
    }
}
