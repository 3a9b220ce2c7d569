//! Lease limits through the builder: refused by name when they break a
//! rule, and carried into a running host's balancing. Virtual time throughout.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use changefeed::balance::EqualShare;
use changefeed::lease::{LeaseStore, MemoryLeaseStore};
use changefeed::processor::{handler_fn, ConfigError, Processor, ProcessorBuilder};
use changefeed::source::MemoryFeed;

use crate::common::{group, setup};

fn builder(store: &MemoryLeaseStore, feed: &MemoryFeed, host: &str) -> ProcessorBuilder {
    Processor::builder()
        .host(host)
        .group("g")
        .store(Arc::new(store.clone()))
        .source(Arc::new(feed.clone()))
        .handler(handler_fn(|_, _| async { Ok(()) }))
        .seed(7)
}

/// Leases per owner ("-" for none).
async fn owners(store: &MemoryLeaseStore) -> BTreeMap<String, usize> {
    let mut count = BTreeMap::new();
    for lease in store.list(&group()).await.unwrap().leases {
        let owner = lease
            .owner
            .as_ref()
            .map_or("-".to_string(), |o| o.to_string());
        *count.entry(owner).or_insert(0) += 1;
    }
    count
}

#[tokio::test]
async fn limits_that_break_a_rule_are_refused_naming_the_setting() {
    // DESIGN "Bad input": refused when built, naming the setting and the rule.
    let (store, feed) = setup(1).await;
    let invalid = |b: ProcessorBuilder| match b.build() {
        Err(ConfigError::Invalid { setting, rule }) => (setting, rule),
        Err(other) => panic!("expected an invalid setting, got {other}"),
        Ok(_) => panic!("limits that break a rule were accepted"),
    };
    let (setting, rule) = invalid(builder(&store, &feed, "a").max_leases(Some(0)));
    assert_eq!(setting, "max_leases");
    assert!(rule.starts_with("must be at least 1"), "{rule}");
    let err = builder(&store, &feed, "a")
        .min_leases(3)
        .max_leases(Some(2))
        .build()
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "min_leases: 3 must not exceed max_leases (2)"
    );
    // The limits configure the default strategy; with another one they would be ignored.
    let custom = || Arc::new(EqualShare::default());
    let (setting, rule) = invalid(
        builder(&store, &feed, "a")
            .max_leases(Some(2))
            .strategy(custom()),
    );
    assert_eq!(setting, "max_leases");
    assert!(rule.contains("EqualShare::with_limits"), "{rule}");
    let (setting, _) = invalid(builder(&store, &feed, "a").min_leases(1).strategy(custom()));
    assert_eq!(setting, "min_leases");
    builder(&store, &feed, "a")
        .min_leases(2)
        .max_leases(Some(2))
        .build()
        .expect("a minimum equal to the maximum is fine");
}

#[tokio::test(start_paused = true)]
async fn running_hosts_hold_at_most_max_leases_and_a_newcomer_takes_the_rest() {
    // Hosts at their maximum take no more; leases nobody may hold stay free until a
    // host with room joins.
    let (store, feed) = setup(6).await;
    let start = |host: &str| {
        builder(&store, &feed, host)
            .max_leases(Some(2))
            .build()
            .unwrap()
            .start()
    };
    let a = start("a");
    let b = start("b");
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(
        owners(&store).await,
        BTreeMap::from([("-".into(), 2), ("a".into(), 2), ("b".into(), 2)])
    );
    let c = start("c");
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(
        owners(&store).await,
        BTreeMap::from([("a".into(), 2), ("b".into(), 2), ("c".into(), 2)])
    );
    for host in [a, b, c] {
        host.stop().await.unwrap();
    }
}

#[tokio::test(start_paused = true)]
async fn a_host_restarted_with_a_lower_maximum_releases_the_excess() {
    // A host above its maximum (it adopted its leases after a restart) releases what nobody
    // asks for, keeping the checkpoints; a host joining later takes them.
    let (store, feed) = setup(6).await;
    let first = builder(&store, &feed, "a").build().unwrap().start();
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(owners(&store).await, BTreeMap::from([("a".into(), 6)]));
    first.kill();
    let again = builder(&store, &feed, "a")
        .max_leases(Some(4))
        .build()
        .unwrap()
        .start();
    tokio::time::sleep(Duration::from_secs(30)).await;
    assert_eq!(
        owners(&store).await,
        BTreeMap::from([("-".into(), 2), ("a".into(), 4)])
    );
    let b = builder(&store, &feed, "b")
        .max_leases(Some(4))
        .build()
        .unwrap()
        .start();
    tokio::time::sleep(Duration::from_secs(10)).await;
    let now = owners(&store).await;
    assert_eq!(now.get("-"), None, "every lease owned: {now:?}");
    assert!(now.values().all(|&n| n <= 4), "{now:?}");
    again.stop().await.unwrap();
    b.stop().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn hosts_with_limits_of_their_own_each_hold_within_them() {
    // Each host publishes its own limits with its heartbeat, and every host plans every host
    // with them: a small host, one without limits and one with a minimum share 10 leases
    // 1 / 4 / 5, and a newcomer capped at 2 takes 2 from the host without limits.
    let (store, feed) = setup(10).await;
    let start = |host: &str, min: usize, max: Option<usize>| {
        builder(&store, &feed, host)
            .min_leases(min)
            .max_leases(max)
            .build()
            .unwrap()
            .start()
    };
    let a = start("a", 0, Some(1));
    let b = start("b", 0, None);
    let c = start("c", 5, None);
    tokio::time::sleep(Duration::from_secs(20)).await;
    assert_eq!(
        owners(&store).await,
        BTreeMap::from([("a".into(), 1), ("b".into(), 4), ("c".into(), 5)])
    );
    let d = start("d", 0, Some(2));
    tokio::time::sleep(Duration::from_secs(20)).await;
    assert_eq!(
        owners(&store).await,
        BTreeMap::from([
            ("a".into(), 1),
            ("b".into(), 2),
            ("c".into(), 5),
            ("d".into(), 2)
        ])
    );
    for host in [a, b, c, d] {
        host.stop().await.unwrap();
    }
}
