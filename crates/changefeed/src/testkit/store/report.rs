//! The conformance check of what a host publishes with its heartbeat
//! ([`crate::model::HostReport`]): stores keep it as text, whatever the role of the write.

use crate::lease::{HeartbeatRole, LeaseStore};
use crate::model::{GroupName, HostName, HostReport, LeaseLoad, PartitionId, Timestamp};

use super::LeaseStoreFixture;

/// A report written with a heartbeat is read back by `membership` and returned by the write;
/// a renewal replaces it, a renewal without one clears it, and a leader's renewal keeps it
/// too. A report of a few kilobytes (a host of 100 leases) fits.
pub(super) async fn heartbeat_reports_round_trip(f: &dyn LeaseStoreFixture) {
    let store = f.connect().await;
    let g = GroupName::new("reports").expect("a valid group name");
    let a = HostName::new("a").expect("a valid host name");
    let mut report = HostReport::new(2.0);
    report.max_leases = Some(7);
    for i in 0..100 {
        report.leases.insert(
            PartitionId::new(format!("shardId-{i:012}")).expect("a valid partition id"),
            LeaseLoad {
                records_per_second: 100.0 + f64::from(i),
                bytes_per_second: 1.0e5,
                busy: 0.25,
            },
        );
    }
    let big = report.to_json();
    assert!(big.len() > 4000, "{} bytes", big.len());
    let first = store
        .heartbeat(
            &g,
            &a,
            "inc",
            Timestamp(1),
            None,
            HeartbeatRole::Member,
            Some(&big),
        )
        .await
        .expect("registered with a report");
    assert_eq!(first.report.as_deref(), Some(big.as_str()));
    let read = reported(store.as_ref(), &g, &a).await;
    assert_eq!(read.as_deref(), Some(big.as_str()));
    let parsed = HostReport::parse(&big).expect("a report parses");
    assert_eq!(parsed.leases.len(), 100);
    assert_eq!(parsed.max_leases, Some(7));

    let small = HostReport::new(1.0).to_json();
    let second = store
        .heartbeat(
            &g,
            &a,
            "inc",
            Timestamp(2),
            Some(first.version),
            HeartbeatRole::Member,
            Some(&small),
        )
        .await
        .expect("renewed with another report");
    assert_eq!(second.report.as_deref(), Some(small.as_str()));
    assert_eq!(
        reported(store.as_ref(), &g, &a).await.as_deref(),
        Some(small.as_str())
    );

    let third = store
        .heartbeat(
            &g,
            &a,
            "inc",
            Timestamp(3),
            Some(second.version),
            HeartbeatRole::Member,
            None,
        )
        .await
        .expect("renewed without a report");
    assert_eq!(third.report, None);
    assert_eq!(reported(store.as_ref(), &g, &a).await, None);

    let fourth = store
        .heartbeat(
            &g,
            &a,
            "inc",
            Timestamp(4),
            Some(third.version),
            HeartbeatRole::Leader,
            Some(&small),
        )
        .await
        .expect("a leader's renewal with a report");
    assert_eq!(fourth.report.as_deref(), Some(small.as_str()));
    assert_eq!(
        reported(store.as_ref(), &g, &a).await.as_deref(),
        Some(small.as_str())
    );
}

async fn reported(store: &dyn LeaseStore, g: &GroupName, h: &HostName) -> Option<String> {
    let m = store.membership(g).await.expect("membership");
    let row = m
        .hosts
        .iter()
        .find(|r| &r.host == h)
        .expect("the host's row is read");
    row.report.as_deref().map(str::to_owned)
}
