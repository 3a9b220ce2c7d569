//! The lag of the partitions this host reads, kept by its workers and published as gauges.

use crate::model::{PartitionId, Timestamp};
use crate::source::OldestUnread;

/// The lag of every partition this host reads: the records, summed into the
/// `changefeed_lag_records` gauge, and the time of each partition's first unread record, whose
/// largest age is the `changefeed_lag_seconds` gauge (label `group` on both). The host
/// republishes the seconds every cycle ([`LagBook::publish_seconds`]), so a worker stuck on a
/// batch shows its lag growing between refreshes. The leader adds the partitions no host
/// reads, so that summed over the fleet the records gauge counts every unread record.
///
/// With [`Settings::lag_per_partition`], each partition's own lag is published too
/// (`changefeed_partition_lag_records` and `changefeed_partition_lag_seconds`, labels `group`
/// and `partition`), and set to 0 when this host stops reading it: summed over the fleet, each
/// partition's series then counts it once, on its current reader.
#[derive(Debug, Default)]
pub(crate) struct LagBook {
    /// Whether each partition's lag is published too.
    per_partition: bool,
    by_partition: std::sync::Mutex<Book>,
    /// On the leader: the partitions no host reads (leases without an owner, partitions
    /// without a lease), counted once for the fleet ([`LagBook::set_unowned`]).
    unowned: std::sync::Mutex<Option<PartitionLag>>,
}

/// Each partition's lag, with the sums the gauges publish kept up to date one partition at a
/// time: a host reading many partitions publishes in O(log partitions), not O(partitions).
#[derive(Debug, Default)]
struct Book {
    lags: std::collections::BTreeMap<PartitionId, PartitionLag>,
    /// The sum of the known record counts.
    records: u64,
    /// How many partitions are caught up.
    caught_up: usize,
    /// The times of the first unread records, with how many partitions have each.
    oldest: std::collections::BTreeMap<Timestamp, usize>,
}

impl Book {
    /// Puts `lag` in place of `partition`'s (none: forgets it), keeping the sums.
    fn set(&mut self, partition: &PartitionId, lag: Option<PartitionLag>) {
        let old = match &lag {
            Some(lag) => self.lags.insert(partition.clone(), *lag),
            None => self.lags.remove(partition),
        };
        if let Some(old) = old {
            self.records = self.records.saturating_sub(old.records.unwrap_or(0));
            match old.oldest {
                OldestUnread::Unknown => {}
                OldestUnread::CaughtUp => self.caught_up -= 1,
                OldestUnread::At(t) => {
                    if let Some(n) = self.oldest.get_mut(&t) {
                        *n -= 1;
                        if *n == 0 {
                            self.oldest.remove(&t);
                        }
                    }
                }
            }
        }
        if let Some(new) = lag {
            self.records = self.records.saturating_add(new.records.unwrap_or(0));
            match new.oldest {
                OldestUnread::Unknown => {}
                OldestUnread::CaughtUp => self.caught_up += 1,
                OldestUnread::At(t) => *self.oldest.entry(t).or_default() += 1,
            }
        }
    }

    fn get(&self, partition: &PartitionId) -> PartitionLag {
        self.lags.get(partition).copied().unwrap_or(PartitionLag {
            records: None,
            oldest: OldestUnread::Unknown,
        })
    }

    /// The largest age at `now` of a first unread record.
    fn max_age_ms(&self, now: Timestamp) -> Option<u64> {
        match self.oldest.keys().next() {
            Some(t) => OldestUnread::At(*t).age_ms(now),
            None => (self.caught_up > 0).then_some(0),
        }
    }
}

/// What a worker last learnt of its partition's lag.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PartitionLag {
    pub records: Option<u64>,
    pub oldest: OldestUnread,
}

impl LagBook {
    /// A book publishing the group's totals, and each partition's lag if `per_partition`.
    pub(crate) fn new(per_partition: bool) -> Self {
        Self {
            per_partition,
            ..Self::default()
        }
    }

    fn book(&self) -> std::sync::MutexGuard<'_, Book> {
        // The lock guards a small map whose every update is a single insert or remove.
        self.by_partition.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records the record count of `partition` (`None`: unknown), keeping its oldest unread.
    pub(super) fn update(
        &self,
        group: &str,
        partition: &PartitionId,
        records: Option<u64>,
        now: Timestamp,
    ) {
        {
            let mut book = self.book();
            let mut lag = book.get(partition);
            lag.records = records;
            book.set(partition, Some(lag));
        }
        if self.per_partition {
            metrics::gauge!("changefeed_partition_lag_records", "group" => group.to_string(), "partition" => partition.to_string())
                .set(records.unwrap_or(0) as f64);
        }
        self.publish(group, now);
    }

    /// Records when `partition`'s first unread record was written.
    pub(super) fn update_oldest(
        &self,
        group: &str,
        partition: &PartitionId,
        oldest: OldestUnread,
        now: Timestamp,
    ) {
        {
            let mut book = self.book();
            let mut lag = book.get(partition);
            lag.oldest = oldest;
            book.set(partition, Some(lag));
        }
        self.publish(group, now);
    }

    /// Forgets `partition` (its worker stopped).
    pub(super) fn remove(&self, group: &str, partition: &PartitionId, now: Timestamp) {
        self.book().set(partition, None);
        if self.per_partition {
            for name in [
                "changefeed_partition_lag_records",
                "changefeed_partition_lag_seconds",
            ] {
                metrics::gauge!(name, "group" => group.to_string(), "partition" => partition.to_string())
                    .set(0.0);
            }
        }
        self.publish(group, now);
    }

    /// Sets (or, with `None`, clears) the lag of the partitions no host reads.
    pub(crate) fn set_unowned(&self, group: &str, lag: Option<PartitionLag>, now: Timestamp) {
        *self.unowned.lock().unwrap_or_else(|p| p.into_inner()) = lag;
        self.publish(group, now);
    }

    fn unowned(&self) -> Option<PartitionLag> {
        *self.unowned.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn publish(&self, group: &str, now: Timestamp) {
        let owned = self.book().records;
        let total = owned.saturating_add(self.unowned().and_then(|u| u.records).unwrap_or(0));
        metrics::gauge!("changefeed_lag_records", "group" => group.to_string()).set(total as f64);
        self.publish_seconds(group, now);
    }

    /// Sets `changefeed_lag_seconds` to the age at `now` of the oldest unread record of the
    /// partitions this host reads (0 when none is known).
    pub(crate) fn publish_seconds(&self, group: &str, now: Timestamp) {
        if self.per_partition {
            for (partition, lag) in self.book().lags.iter() {
                let ms = lag.oldest.age_ms(now).unwrap_or(0);
                metrics::gauge!("changefeed_partition_lag_seconds", "group" => group.to_string(), "partition" => partition.to_string())
                    .set(ms as f64 / 1000.0);
            }
        }
        let max_ms = self.max_age_ms(now).unwrap_or(0);
        metrics::gauge!("changefeed_lag_seconds", "group" => group.to_string())
            .set(max_ms as f64 / 1000.0);
    }

    /// The largest known age at `now` of a first unread record, in milliseconds.
    pub(crate) fn max_age_ms(&self, now: Timestamp) -> Option<u64> {
        self.book().max_age_ms(now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lag_seconds_is_the_oldest_unread_age_over_owned_partitions() {
        // changefeed_lag_seconds is the largest age of a first unread record among
        // the partitions this host reads; it grows while no refresh moves it, and a stopped
        // worker's partition no longer counts.
        let book = LagBook::default();
        let p0 = PartitionId::new("0").expect("valid");
        let p1 = PartitionId::new("1").expect("valid");
        assert_eq!(book.max_age_ms(Timestamp(0)), None, "nothing known yet");
        book.update_oldest(
            "g",
            &p0,
            OldestUnread::At(Timestamp(1_000)),
            Timestamp(5_000),
        );
        book.update_oldest("g", &p1, OldestUnread::CaughtUp, Timestamp(5_000));
        book.update("g", &p1, Some(0), Timestamp(5_000));
        assert_eq!(book.max_age_ms(Timestamp(5_000)), Some(4_000));
        assert_eq!(
            book.max_age_ms(Timestamp(65_000)),
            Some(64_000),
            "a stuck worker's lag grows with the clock"
        );
        book.update("g", &p0, Some(7), Timestamp(65_000));
        assert_eq!(
            book.max_age_ms(Timestamp(65_000)),
            Some(64_000),
            "a record count keeps the known time"
        );
        book.update("g", &p1, Some(3), Timestamp(65_000));
        assert_eq!(book.book().records, 10, "the record counts are summed");
        book.remove("g", &p0, Timestamp(65_000));
        assert_eq!(
            book.max_age_ms(Timestamp(65_000)),
            Some(0),
            "p1 is caught up"
        );
        assert_eq!(
            book.book().records,
            3,
            "a stopped worker's records no longer count"
        );
        book.remove("g", &p1, Timestamp(65_000));
        assert_eq!(book.max_age_ms(Timestamp(65_000)), None, "nothing read");
    }
}
