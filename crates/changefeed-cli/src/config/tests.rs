use super::*;

#[test]
fn protocol_is_batch_lines_or_kcl_and_kcl_checkpoints_where_asked() {
    let with = |protocol: Option<&str>, checkpoint: Option<&str>| {
        RunArgs {
            protocol: protocol.map(Into::into),
            checkpoint: checkpoint.map(Into::into),
            ..args()
        }
        .resolve()
    };
    assert_eq!(with(None, None).expect("valid").protocol, Protocol::Batch);
    assert_eq!(
        with(Some("lines"), None).expect("valid").protocol,
        Protocol::Lines
    );
    let kcl = with(Some("kcl"), None).expect("valid");
    assert_eq!(kcl.protocol, Protocol::Kcl);
    assert_eq!(kcl.settings.checkpoint_mode, CheckpointMode::Manual);
    let err = with(Some("kcl"), Some("every-batch")).expect_err("checkpoint refused");
    assert!(err.0.starts_with("checkpoint: the kcl protocol"), "{err}");
    let err = with(Some("grpc"), None).expect_err("unknown");
    assert_eq!(err.0, "protocol: \"grpc\" must be batch, lines or kcl");
}

fn args() -> RunArgs {
    RunArgs {
        store: Some("sqlite://s.db".into()),
        source: Some("sqlite://s.db".into()),
        handler: Some("cat".into()),
        ..RunArgs::default()
    }
}

#[test]
fn flags_win_over_the_file_and_the_file_over_defaults() {
    // Precedence: flags (and env, which clap folds in) > file > defaults.
    let mut a = args();
    a.lease_expiry = Some("6s".into());
    a.merge_file(
        "f.toml",
        "lease_expiry = \"30s\"\nrenew_interval = \"1s\"\nmax_batch_size = 7\n",
    )
    .expect("valid file");
    let c = a.resolve().expect("valid");
    assert_eq!(c.settings.lease_expiry, Duration::from_secs(6));
    assert_eq!(c.settings.renew_interval, Duration::from_secs(1));
    assert_eq!(c.settings.max_batch_size, 7);
    assert_eq!(
        c.settings.acquire_interval,
        Settings::default().acquire_interval
    );
}

#[test]
fn bad_values_name_the_setting() {
    // DESIGN "Bad input": errors name the setting and the rule.
    let mut a = args();
    a.renew_interval = Some("soon".into());
    let err = a.resolve().expect_err("bad duration");
    assert!(err.0.starts_with("renew_interval:"), "{err}");
    let mut a = args();
    a.lease_expiry = Some("3s".into());
    a.renew_interval = Some("5s".into());
    let err = a.resolve().expect_err("renew above expiry");
    assert!(err.0.starts_with("renew_interval:"), "{err}");
    let mut a = args();
    a.checkpoint = Some("manual".into());
    assert!(a
        .resolve()
        .expect_err("manual")
        .0
        .starts_with("checkpoint:"));
    let mut a = args();
    let err = a
        .merge_file("f.toml", "lease_expiri = \"1s\"")
        .expect_err("typo");
    assert!(err.0.contains("lease_expiri"), "{err}");
}

#[test]
fn durations_the_library_refuses_are_usage_errors_naming_the_setting() {
    // A huge duration or a zero safety margin is refused before anything starts.
    for (key, value) in [
        ("lease_expiry", "500000000000y"),
        ("acquire_interval", "100000000000y"),
        ("renew_interval", "100000000000y"),
        ("lease_expiry", "400days"),
        ("safety_margin", "0s"),
        ("cleanup_delay", "0s"),
    ] {
        let mut a = args();
        *a.field(key).expect("a known key") = Some(value.into());
        let err = a.resolve().expect_err(value);
        assert!(
            err.0.starts_with(&format!("{key}:")),
            "{key}={value}: {err}"
        );
    }
    let mut a = args();
    a.checkpoint = Some("interval:0s".into());
    let err = a.resolve().expect_err("zero interval");
    assert!(err.0.starts_with("checkpoint:"), "{err}");
    let err = parse_duration("lease_expiry", "500000000000y").expect_err("too long");
    assert_eq!(
        err.0,
        "lease_expiry: \"500000000000y\" is longer than the longest accepted duration, 365 days"
    );
}

#[test]
fn a_short_lease_expiry_alone_scales_the_margin_and_the_stop_down() {
    // Only lease_expiry given: the defaults that would exceed it follow it down.
    let mut a = args();
    a.lease_expiry = Some("3s".into());
    a.renew_interval = Some("500ms".into());
    a.acquire_interval = Some("200ms".into());
    let c = a.resolve().expect("valid");
    assert!(c.settings.shutdown_timeout <= c.settings.lease_expiry);
}

#[test]
fn stop_handler_and_dead_letter_settings_are_read_and_checked() {
    // The stop and handler bounds reach the library; a dead-letter count without
    // its command is a usage error naming the flag.
    let mut a = args();
    a.shutdown_timeout = Some("3s".into());
    a.merge_file(
        "f.toml",
        "handler_timeout = \"30s\"\ndead_letter_after = 4\ndead_letter_command = \"cat\"\n",
    )
    .expect("valid file");
    let c = a.resolve().expect("valid");
    assert_eq!(c.settings.shutdown_timeout, Duration::from_secs(3));
    assert_eq!(c.settings.handler_timeout, Some(Duration::from_secs(30)));
    assert_eq!(c.settings.dead_letter_after, Some(4));
    assert_eq!(c.dead_letter_command.as_deref(), Some("cat"));
    let mut a = args();
    a.dead_letter_after = Some("3".into());
    let err = a.resolve().expect_err("no command");
    assert!(err.0.contains("--dead-letter-after"), "{err}");
    let mut a = args();
    a.dead_letter_command = Some("cat".into());
    let err = a.resolve().expect_err("no count");
    assert!(err.0.starts_with("dead_letter_command:"), "{err}");
    let mut a = args();
    a.lease_expiry = Some("6s".into());
    a.shutdown_timeout = Some("7s".into());
    let err = a.resolve().expect_err("above expiry");
    assert!(err.0.starts_with("shutdown_timeout:"), "{err}");
    let mut a = args();
    a.handler_timeout = Some("0s".into());
    let err = a.resolve().expect_err("zero");
    assert!(err.0.starts_with("handler_timeout:"), "{err}");
}

#[test]
fn idle_tick_and_per_partition_lag_are_read_and_checked_by_name() {
    // --max-wait-time and --lag-per-partition reach the library's
    // settings, from flags or the file; bad values name the setting.
    let c = args().resolve().expect("valid");
    assert_eq!(
        (c.settings.max_wait_time, c.settings.lag_per_partition),
        (None, false)
    );
    let mut a = args();
    a.max_wait_time = Some("30s".into());
    a.merge_file(
        "f.toml",
        "lag_per_partition = true\nmax_wait_time = \"5s\"\n",
    )
    .expect("valid file");
    let c = a.resolve().expect("valid");
    assert_eq!(c.settings.max_wait_time, Some(Duration::from_secs(30)));
    assert!(c.settings.lag_per_partition);
    for (wait, per, message) in [
        (Some("0s"), None, "max_wait_time: must be greater than zero"),
        (
            Some("soon"),
            None,
            "max_wait_time: \"soon\" is not a duration",
        ),
        (
            None,
            Some("yes"),
            "lag_per_partition: \"yes\" is not true or false",
        ),
    ] {
        let mut a = args();
        a.max_wait_time = wait.map(Into::into);
        a.lag_per_partition = per.map(Into::into);
        let err = a.resolve().expect_err(message);
        assert!(err.0.starts_with(message), "{err}");
    }
}

#[test]
fn deliver_outside_shard_is_read_for_a_kinesis_source_only() {
    // --kinesis-deliver-outside-shard reaches the Kinesis source's read options, from the
    // flag or the file; off by default (the KCL's drop); refused, naming the setting, for
    // a bad value or a source that is not Kinesis.
    let kinesis = || RunArgs {
        source: Some("kinesis://orders?endpoint=http://127.0.0.1:1".into()),
        ..args()
    };
    assert!(
        !kinesis()
            .resolve()
            .expect("valid")
            .kinesis
            .deliver_outside_shard
    );
    let mut a = kinesis();
    a.kinesis_deliver_outside_shard = Some("true".into());
    assert!(a.resolve().expect("valid").kinesis.deliver_outside_shard);
    let mut a = kinesis();
    a.merge_file("f.toml", "kinesis_deliver_outside_shard = true\n")
        .expect("valid file");
    assert!(a.resolve().expect("valid").kinesis.deliver_outside_shard);
    let mut a = kinesis();
    a.kinesis_deliver_outside_shard = Some("always".into());
    let err = a.resolve().expect_err("not a bool");
    assert!(
        err.0
            .starts_with("kinesis_deliver_outside_shard: \"always\" is not true or false"),
        "{err}"
    );
    let mut a = args();
    a.kinesis_deliver_outside_shard = Some("true".into());
    let err = a.resolve().expect_err("not a kinesis source");
    assert!(
        err.0
            .starts_with("kinesis_deliver_outside_shard: only a kinesis:// source"),
        "{err}"
    );
    let mut a = args();
    a.kinesis_deliver_outside_shard = Some("false".into());
    assert!(
        !a.resolve()
            .expect("false is the default anywhere")
            .kinesis
            .deliver_outside_shard
    );
}

#[test]
fn kinesis_retrieval_chooses_polling_or_fan_out_and_wins_over_the_url() {
    // --kinesis-retrieval: polling, fanout (a consumer named after the group) or
    // fanout:NAME, from the flag or the file, over the URL's retrieval=; refused by name for
    // a bad value, a bad consumer name or a source that is not Kinesis.
    use changefeed_kinesis::Retrieval;
    let resolved = |retrieval: &str, url: &str| {
        let mut a = RunArgs {
            source: Some(format!("kinesis://orders?endpoint=http://127.0.0.1:1{url}")),
            group: Some("billing".into()),
            ..args()
        };
        if !retrieval.is_empty() {
            a.kinesis_retrieval = Some(retrieval.into());
        }
        a.resolve().map(|c| match c.source {
            BackendUrl::Kinesis(aws) => aws.retrieval,
            other => panic!("a kinesis source: {other:?}"),
        })
    };
    let fan = |name: &str| Retrieval::FanOut {
        consumer_name: name.into(),
    };
    assert_eq!(resolved("", ""), Ok(Retrieval::Polling));
    assert_eq!(resolved("fanout", ""), Ok(fan("billing")));
    assert_eq!(resolved("fanout:app-1", ""), Ok(fan("app-1")));
    assert_eq!(
        resolved("polling", "&retrieval=fanout&consumer=c"),
        Ok(Retrieval::Polling)
    );
    assert_eq!(resolved("", "&retrieval=fanout&consumer=c"), Ok(fan("c")));
    let mut a = RunArgs {
        source: Some("kinesis://orders?endpoint=http://127.0.0.1:1".into()),
        ..args()
    };
    a.merge_file("f.toml", "kinesis_retrieval = \"fanout:from-file\"\n")
        .expect("valid file");
    match a.resolve().expect("valid").source {
        BackendUrl::Kinesis(aws) => assert_eq!(aws.retrieval, fan("from-file")),
        other => panic!("a kinesis source: {other:?}"),
    }
    for (bad, says) in [
        (
            "push",
            "kinesis_retrieval: \"push\" must be polling, fanout or fanout:CONSUMER",
        ),
        ("fanout:a/b", "kinesis_retrieval: the consumer name \"a/b\""),
    ] {
        let err = resolved(bad, "").expect_err(bad);
        assert!(err.0.starts_with(says), "{err}");
    }
    let mut a = args();
    a.kinesis_retrieval = Some("fanout".into());
    let err = a.resolve().expect_err("not a kinesis source");
    assert!(
        err.0
            .starts_with("kinesis_retrieval: only a kinesis:// source"),
        "{err}"
    );
}

#[test]
fn max_unhealthy_and_start_timeout_are_read_and_checked_by_name() {
    // --max-unhealthy reaches the library (default none: 3 × lease_expiry) and is checked
    // by it; --start-timeout is the CLI's own, 60s by default, and may be zero.
    let c = args().resolve().expect("valid");
    assert_eq!(c.settings.max_unhealthy, None);
    assert_eq!(c.settings.unhealthy_after(), Duration::from_secs(30));
    assert_eq!(c.start_timeout, DEFAULT_START_TIMEOUT);
    let mut a = args();
    a.max_unhealthy = Some("45s".into());
    a.merge_file("f.toml", "start_timeout = \"0s\"\nmax_unhealthy = \"1m\"\n")
        .expect("valid file");
    let c = a.resolve().expect("valid");
    assert_eq!(c.settings.max_unhealthy, Some(Duration::from_secs(45)));
    assert_eq!(c.start_timeout, Duration::ZERO);
    for (max, start, message) in [
        (
            Some("5s"),
            None,
            "max_unhealthy: 5s must be at least lease_expiry (10s)",
        ),
        (Some("0s"), None, "max_unhealthy: must be greater than zero"),
        (
            None,
            Some("soon"),
            "start_timeout: \"soon\" is not a duration",
        ),
        (
            None,
            Some("400days"),
            "start_timeout: \"400days\" is longer than the longest accepted duration",
        ),
    ] {
        let mut a = args();
        a.max_unhealthy = max.map(Into::into);
        a.start_timeout = start.map(Into::into);
        let err = a.resolve().expect_err(message);
        assert!(err.0.starts_with(message), "{err}");
    }
}

#[test]
fn lease_limits_are_read_and_checked_by_name() {
    // --min-leases and --max-leases reach the library's settings; limits that
    // break a rule are usage errors naming the setting.
    let mut a = args();
    a.max_leases = Some("8".into());
    a.merge_file("f.toml", "min_leases = 2\nmax_leases = 3\n")
        .expect("valid file");
    let c = a.resolve().expect("valid");
    assert_eq!((c.settings.min_leases, c.settings.max_leases), (2, Some(8)));
    let c = args().resolve().expect("valid");
    assert_eq!((c.settings.min_leases, c.settings.max_leases), (0, None));
    for (min, max, message) in [
        (None, Some("0"), "max_leases: must be at least 1"),
        (
            Some("5"),
            Some("2"),
            "min_leases: 5 must not exceed max_leases (2)",
        ),
        (Some("-1"), None, "min_leases: \"-1\" is not a whole number"),
        (
            None,
            Some("lots"),
            "max_leases: \"lots\" is not a whole number",
        ),
    ] {
        let mut a = args();
        a.min_leases = min.map(Into::into);
        a.max_leases = max.map(Into::into);
        let err = a.resolve().expect_err(message);
        assert!(err.0.starts_with(message), "{err}");
    }
}

#[test]
fn capacity_and_publish_load_are_read_and_checked_by_name() {
    let mut a = args();
    a.merge_file("f.toml", "capacity = \"2.5\"\npublish_load = \"true\"\n")
        .expect("valid file");
    let c = a.resolve().expect("valid");
    assert_eq!(c.settings.capacity, Some(2.5));
    assert!(c.settings.publish_load);
    let c = args().resolve().expect("valid");
    assert_eq!(
        (c.settings.capacity, c.settings.publish_load),
        (None, false)
    );
    for (value, message) in [
        ("lots", "capacity: \"lots\" is not a number"),
        ("0", "capacity: 0 must be above 0 and finite"),
        ("-1", "capacity: -1 must be above 0 and finite"),
        ("inf", "capacity: inf must be above 0 and finite"),
    ] {
        let mut a = args();
        a.capacity = Some(value.into());
        let err = a.resolve().expect_err(message);
        assert!(err.0.starts_with(message), "{err}");
    }
}

#[test]
fn strategy_load_publishes_loads_and_refuses_lease_limits() {
    use super::Strategy;
    let mut a = args();
    a.merge_file("f.toml", "strategy = \"load\"\n")
        .expect("valid file");
    let c = a.resolve().expect("valid");
    assert_eq!(c.strategy, Strategy::Load);
    assert!(c.settings.publish_load);
    let c = args().resolve().expect("valid");
    assert_eq!(
        (c.strategy, c.settings.publish_load),
        (Strategy::Equal, false)
    );
    let mut a = args();
    a.strategy = Some("load".into());
    a.max_leases = Some("3".into());
    let err = a.resolve().expect_err("limits with load");
    assert!(
        err.0.starts_with("strategy: load balances measured load"),
        "{err}"
    );
    let mut a = args();
    a.strategy = Some("fast".into());
    let err = a.resolve().expect_err("an unknown strategy");
    assert!(
        err.0.starts_with("strategy: \"fast\" is not a strategy"),
        "{err}"
    );
}

proptest::proptest! {
    #[test]
    fn parsing_any_duration_never_panics(text in "\\PC{0,30}", digits in "[0-9]{1,30}",
                                        unit in "(ns|us|ms|s|m|h|d|w|M|y|)") {
        // Bad input is an error naming the setting, never a panic.
        if let Err(e) = parse_duration("poll_delay", &text) {
            proptest::prop_assert!(e.0.starts_with("poll_delay:"));
        }
        let _ = parse_duration("poll_delay", &format!("{digits}{unit}"));
        let _ = parse_checkpoint(&text);
        let _ = parse_position(&text);
    }

    #[test]
    fn resolving_any_settings_never_panics(
        values in proptest::collection::vec(
            proptest::option::of("([0-9]{1,22}(ns|ms|s|m|h|d|y)|[0-9]{1,22}|\\PC{0,12})"),
            KEYS.len(),
        ),
    ) {
        // Every key at once, each absent, a number, a duration of any size, or junk.
        let mut a = args();
        for (key, value) in KEYS.iter().zip(values) {
            if matches!(*key, "store" | "source" | "handler") {
                continue;
            }
            *a.field(key).expect("a known key") = value;
        }
        let _ = a.resolve();
    }

    #[test]
    fn merging_any_config_file_never_panics(
        text in "\\PC{0,80}",
        key in proptest::sample::select(KEYS.to_vec()),
        value in "\\PC{0,20}",
    ) {
        // Arbitrary text, and well-formed TOML with any value under a real key.
        let _ = args().merge_file("f.toml", &text);
        let mut a = args();
        let file = format!("{key} = {}", toml::Value::String(value));
        if a.merge_file("f.toml", &file).is_ok() {
            let _ = a.resolve();
        }
    }
}

#[test]
fn key_concurrency_is_read_by_name_and_refused_with_the_kcl_protocol() {
    // DESIGN "Bad input": a bad value, or key-parallel calls on the KCL protocol, whose
    // record processor serves its whole shard in order, is refused naming key_concurrency.
    assert_eq!(args().resolve().expect("valid").key_concurrency, 1);
    let mut a = args();
    a.merge_file("f.toml", "key_concurrency = 8\n")
        .expect("valid file");
    assert_eq!(a.resolve().expect("valid").key_concurrency, 8);
    let mut a = args();
    a.key_concurrency = Some("many".into());
    let err = a.resolve().expect_err("not a number");
    assert!(err.0.starts_with("key_concurrency: \"many\""), "{err}");
    let four_over = |protocol: &str| {
        let mut a = args();
        a.key_concurrency = Some("4".into());
        a.protocol = Some(protocol.into());
        a.resolve()
    };
    assert_eq!(
        four_over("lines").expect("lines takes it").key_concurrency,
        4
    );
    let err = four_over("kcl").expect_err("not with the KCL protocol");
    assert!(
        err.0
            .starts_with("key_concurrency: 4 needs --protocol batch or lines"),
        "{err}"
    );
}
