//! Parsing and opening store and source URLs.

use super::*;

#[test]
fn aws_urls_name_the_table_or_stream_and_refuse_the_wrong_role() {
    // dynamodb:// is a store, kinesis:// a source; overrides come as ?endpoint= and ?region=.
    assert_eq!(
        BackendUrl::store(
            "--store",
            "dynamodb://leases?endpoint=http://127.0.0.1:8000&region=eu-west-1"
        )
        .expect("valid"),
        BackendUrl::Dynamodb(AwsUrl {
            name: "leases".into(),
            endpoint: Some("http://127.0.0.1:8000".into()),
            region: Some("eu-west-1".into()),
            connect_timeout: None,
            request_timeout: None,
            stream: None,
            record: None,
            retrieval: changefeed_kinesis::Retrieval::Polling,
        })
    );
    assert!(matches!(
        BackendUrl::source("--source", "kinesis://orders").expect("valid"),
        BackendUrl::Kinesis(AwsUrl { ref name, endpoint: None, region: None, .. }) if name == "orders"
    ));
    let err = BackendUrl::source("--source", "dynamodb://t").expect_err("a store");
    assert!(err.to_string().contains("--source"), "{err}");
    let err = BackendUrl::store("--store", "kinesis://s").expect_err("a source");
    assert!(err.to_string().contains("kinesis://"), "{err}");
    let err = BackendUrl::store("--store", "dynamodb://t?colour=red").expect_err("bad query");
    assert!(err.to_string().contains("endpoint"), "{err}");
    assert!(BackendUrl::store("--store", "dynamodb://").is_err());
    // Several streams, one lease table (multi-stream).
    assert!(matches!(
        BackendUrl::source("--source", "kinesis://orders,payments").expect("valid"),
        BackendUrl::Kinesis(AwsUrl { ref name, .. }) if name == "orders,payments"
    ));
    assert!(BackendUrl::source("--source", "kinesis://orders,").is_err());
    assert!(BackendUrl::source("--source", "kinesis://a:b").is_err());
}

#[test]
fn cosmos_urls_name_account_database_and_container_and_take_the_key_only_from_outside() {
    let url = BackendUrl::store("--store", "cosmos://my-account/app/leases").expect("valid");
    let BackendUrl::Cosmos(cosmos) = &url else {
        panic!("{url:?}")
    };
    assert_eq!(
        (cosmos.account.as_str(), cosmos.database.as_str()),
        ("my-account", "app")
    );
    assert_eq!(cosmos.container, "leases");
    assert_eq!(
        cosmos.endpoint(),
        "https://my-account.documents.azure.com:443/"
    );
    // An account needs its key; the error names the variable and shows no key.
    let err = cosmos.options(None).expect_err("no key");
    assert!(err.0.contains(COSMOS_KEY_VAR), "{err}");
    let options = cosmos.options(Some("c2VjcmV0".into())).expect("key");
    assert!(!format!("{options:?}").contains("c2VjcmV0"));
    // A server named by ?endpoint= (emulator, local server) goes without.
    let local = BackendUrl::store(
        "--store",
        "cosmos://local/app/leases?endpoint=http://127.0.0.1:8081",
    )
    .expect("valid");
    let BackendUrl::Cosmos(local) = local else {
        panic!("cosmos")
    };
    assert_eq!(local.endpoint(), "http://127.0.0.1:8081");
    assert!(local.options(None).is_ok());
    // It is a source too.
    assert!(matches!(
        BackendUrl::source("--source", "cosmos://acct/app/orders"),
        Ok(BackendUrl::Cosmos(_))
    ));
    // Bad shapes name the setting and the part.
    for (text, says) in [
        ("cosmos://acct/app", "needs ACCOUNT/DATABASE/CONTAINER"),
        (
            "cosmos://acct/app/leases/more",
            "needs ACCOUNT/DATABASE/CONTAINER",
        ),
        ("cosmos://Acct/app/leases", "account \"Acct\""),
        ("cosmos://ab/app/leases", "account \"ab\""),
        ("cosmos://acct//leases", "database \"\""),
        ("cosmos://acct/app/le#ses", "container \"le#ses\""),
        (
            "cosmos://acct/app/leases?key=abc",
            "accepts only ?endpoint=URL",
        ),
        (
            "cosmos://acct/app/leases?endpoint=ftp://x",
            "parameter endpoint",
        ),
    ] {
        let err = BackendUrl::store("--store", text).expect_err(text);
        assert!(err.0.starts_with("--store: "), "{text}: {err}");
        assert!(err.0.contains(says), "{text}: {err}");
    }
}

#[test]
fn sqlite_urls_keep_the_path_and_other_schemes_are_named() {
    // Bad URLs are usage errors naming the flag and the supported schemes.
    assert_eq!(
        BackendUrl::parse("--store", "sqlite:///tmp/a.db").expect("valid"),
        BackendUrl::Sqlite(PathBuf::from("/tmp/a.db"))
    );
    assert_eq!(
        BackendUrl::parse("--store", "sqlite://a.db").expect("valid"),
        BackendUrl::Sqlite(PathBuf::from("a.db"))
    );
    let err = BackendUrl::parse("--store", "redis://x").expect_err("unknown");
    assert!(
        err.0.contains("--store") && err.0.contains("sqlite://"),
        "{err}"
    );
    let err = BackendUrl::parse("--source", "feed.db").expect_err("not a URL");
    assert!(err.0.contains("--source"), "{err}");
    assert!(BackendUrl::parse("--store", "sqlite://").is_err());
}

#[test]
fn postgres_urls_take_out_prefix_and_pool_size_and_keep_the_rest() {
    // Our parameters configure the backend; libpq's go to the driver unchanged.
    let BackendUrl::Postgres(pg) = BackendUrl::store(
        "--store",
        "postgresql://u:secret@db:5433/app?prefix=orders&sslmode=require&pool_size=3",
    )
    .expect("valid") else {
        panic!("a lease store URL");
    };
    assert_eq!(pg.conn, "postgres://u:secret@db:5433/app?sslmode=require");
    assert_eq!(pg.prefix, "orders");
    assert_eq!(pg.pool_size, Some(3));
    let BackendUrl::PostgresOutbox(pg) =
        BackendUrl::source("--source", "postgres-outbox://u@db/app").expect("valid")
    else {
        panic!("an outbox URL");
    };
    assert_eq!(pg.conn, "postgres://u@db/app");
    assert_eq!(pg.prefix, changefeed_postgres::DEFAULT_PREFIX);
}

#[test]
fn postgres_urls_take_out_the_timeouts_and_leave_the_drivers_own() {
    // Our timeouts configure the pool; libpq's connect_timeout and keepalives go on.
    let BackendUrl::Postgres(pg) = BackendUrl::store(
        "--store",
        "postgres://u@db/app?request_timeout=2s&statement_timeout=1500ms&connect_timeout=2&keepalives_idle=5",
    )
    .expect("valid") else {
        panic!("a lease store URL");
    };
    assert_eq!(
        pg.conn,
        "postgres://u@db/app?connect_timeout=2&keepalives_idle=5"
    );
    let options = pg.options();
    assert_eq!(
        options.client_timeout_value(),
        std::time::Duration::from_secs(2)
    );
    assert_eq!(
        options.statement_timeout_value(),
        std::time::Duration::from_millis(1500)
    );
    for bad in [
        "postgres://u@db/app?request_timeout=soon",
        "postgres://u@db/app?statement_timeout=0s",
        "postgres://u@db/app?request_timeout=1s&statement_timeout=2s",
    ] {
        let err = BackendUrl::store("--store", bad).expect_err(bad);
        assert!(
            err.0.starts_with("--store:") && err.0.contains("_timeout"),
            "{err}"
        );
    }
}

#[test]
fn bad_postgres_urls_name_the_flag_and_hide_the_password() {
    // DESIGN "Bad input": the error names the setting; secrets never reach the output.
    let err = BackendUrl::store("--store", "postgres://u:secret@db/app?prefix=Bad-Name")
        .expect_err("bad prefix");
    assert!(
        err.0.starts_with("--store:") && err.0.contains("prefix"),
        "{err}"
    );
    assert!(!err.0.contains("secret"), "{err}");
    let err = BackendUrl::store("--store", "postgres://u:secret@db/app?bogus_option=1")
        .expect_err("unknown driver option");
    assert!(!err.0.contains("secret"), "{err}");
    let err = BackendUrl::store("--store", "postgres-outbox://db/app").expect_err("a source");
    assert!(err.0.contains("postgres://"), "{err}");
    let err = BackendUrl::source("--source", "postgres://db/app").expect_err("a store");
    assert!(err.0.contains("postgres-outbox://"), "{err}");
    let err = BackendUrl::store("--store", "postgres://db/app?pool_size=0").expect_err("zero");
    assert!(err.0.contains("pool_size"), "{err}");
    let url = BackendUrl::store("--store", "postgres://u:secret@db/app").expect("valid");
    assert!(!format!("{url:?}").contains("secret"));
    assert_eq!(url.redacted(), "postgres://u:***@db/app");
    let url = BackendUrl::source(
        "--source",
        "postgres-outbox://u@db/app?password=secret&prefix=p&sslmode=disable",
    )
    .expect("valid");
    assert_eq!(
        url.redacted(),
        "postgres-outbox://u@db/app?password=***&sslmode=disable"
    );
    assert!(!format!("{url:?}").contains("secret"));
}

#[test]
fn a_postgres_url_without_a_host_or_with_a_bad_part_says_which() {
    // `postgres://` without a host is a usage error; a bad part is named.
    for text in ["postgres://", "postgres:///app", "postgres://u:secret@/app"] {
        let err = BackendUrl::store("--store", text).expect_err("no host");
        assert!(
            err.0.starts_with("--store: postgres:// needs a host"),
            "{text}: {err}"
        );
        assert!(!err.0.contains("secret"), "{err}");
    }
    let err =
        BackendUrl::store("--store", "postgres://u:secret@db:notaport/app").expect_err("bad port");
    assert_eq!(
        err.0,
        "--store: postgres://u:***@db:notaport/app: invalid connection string: invalid value for option `port`"
    );
    let err = BackendUrl::store("--store", "postgres://db/app?bogus_option=1")
        .expect_err("unknown option");
    assert!(err.0.ends_with("unknown option `bogus_option`"), "{err}");
    // A socket directory is a host.
    assert!(BackendUrl::store("--store", "postgres:///app?host=/run/postgresql").is_ok());
}

#[test]
fn aws_endpoints_regions_and_names_are_checked_before_connecting() {
    // Bad input is a usage error naming the parameter, not an SDK error at the first call.
    for endpoint in [
        "notaurl",
        "http://",
        "http://[::1",
        "http://127.0.0.1:1:2",
        "http://h:99999",
        "ftp://h",
        "http://a b",
    ] {
        let err = BackendUrl::store(
            "--store",
            &format!("dynamodb://leases?endpoint={endpoint}&region=us-east-1"),
        )
        .expect_err(endpoint);
        assert!(
            err.0
                .starts_with("--store: dynamodb:// parameter endpoint:"),
            "{endpoint}: {err}"
        );
    }
    for endpoint in [
        "http://127.0.0.1:8000",
        "https://dynamodb.eu-west-1.amazonaws.com",
        "http://[::1]:8000/",
        "http://localhost",
    ] {
        let url = format!("dynamodb://leases?endpoint={endpoint}");
        assert!(BackendUrl::store("--store", &url).is_ok(), "{endpoint}");
    }
    let err = BackendUrl::store("--store", "dynamodb://leases?region=EU/1").expect_err("region");
    assert!(err.0.contains("parameter region"), "{err}");
    let err = BackendUrl::store("--store", "dynamodb://t%%").expect_err("table name");
    assert!(err.0.contains("table name \"t%%\""), "{err}");
    let err = BackendUrl::source("--source", "kinesis://ok,bad*").expect_err("stream name");
    assert!(err.0.contains("stream name \"bad*\""), "{err}");
}

#[test]
fn timeouts_are_url_parameters_of_the_aws_and_cosmos_urls_and_bad_values_name_the_parameter() {
    use std::time::Duration;
    let BackendUrl::Dynamodb(aws) = BackendUrl::store(
        "--store",
        "dynamodb://leases?connect_timeout=500ms&request_timeout=3s",
    )
    .expect("valid") else {
        panic!("dynamodb")
    };
    let options = aws.options();
    assert_eq!(options.connect_timeout, Some(Duration::from_millis(500)));
    assert_eq!(options.request_timeout, Some(Duration::from_secs(3)));
    let BackendUrl::Kinesis(aws) =
        BackendUrl::source("--source", "kinesis://orders?request_timeout=10s").expect("valid")
    else {
        panic!("kinesis")
    };
    assert_eq!(aws.request_timeout, Some(Duration::from_secs(10)));
    assert_eq!(aws.connect_timeout, None, "the backend's default");
    let BackendUrl::Cosmos(cosmos) = BackendUrl::store(
        "--store",
        "cosmos://local/app/leases?endpoint=http://127.0.0.1:8081&connect_timeout=2s&request_timeout=4s",
    )
    .expect("valid") else {
        panic!("cosmos")
    };
    assert_eq!(cosmos.connect_timeout, Some(Duration::from_secs(2)));
    assert_eq!(cosmos.request_timeout, Some(Duration::from_secs(4)));
    let shown = format!("{:?}", cosmos.options(None).expect("options"));
    assert!(
        shown.contains("connect_timeout: 2s") && shown.contains("timeout: 4s"),
        "{shown}"
    );
    for (text, says) in [
        (
            "dynamodb://t?connect_timeout=soon",
            "dynamodb:// parameter connect_timeout: \"soon\"",
        ),
        (
            "dynamodb://t?request_timeout=0s",
            "dynamodb:// parameter request_timeout: \"0s\"",
        ),
        (
            "dynamodb://t?request_timeout=",
            "dynamodb:// parameter request_timeout: \"\"",
        ),
        ("dynamodb://t?request_timeout=2h", "at most 1h"),
        (
            "cosmos://acct/app/leases?request_timeout=-1s",
            "cosmos:// parameter request_timeout",
        ),
        (
            "cosmos://acct/app/leases?connect_timeout=5",
            "cosmos:// parameter connect_timeout",
        ),
    ] {
        let err = BackendUrl::store("--store", text).expect_err(text);
        assert!(err.0.starts_with("--store: "), "{text}: {err}");
        assert!(err.0.contains(says), "{text}: {err}");
    }
    let err = BackendUrl::source("--source", "kinesis://s?connect_timeout=1").expect_err("no unit");
    assert!(
        err.0.contains("kinesis:// parameter connect_timeout") && err.0.contains("such as 2s"),
        "{err}"
    );
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2000))]

    #[test]
    fn parsing_any_url_never_panics(
        scheme in proptest::sample::select(vec![
            "", "sqlite://", "postgres://", "postgresql://", "postgres-outbox://",
            "dynamodb://", "kinesis://", "cosmos://", "redis://",
        ]),
        rest in "\\PC{0,60}",
    ) {
        // Bad input is an error, never a panic.
        let text = format!("{scheme}{rest}");
        let _ = BackendUrl::parse("--store", &text);
        let _ = BackendUrl::store("--store", &text);
        let _ = BackendUrl::source("--source", &text);
        let _ = redact(&text);
    }

    #[test]
    fn parsing_url_shaped_text_never_panics(
        scheme in proptest::sample::select(vec!["postgres", "dynamodb", "kinesis", "cosmos"]),
        user in "[a-z:@%]{0,8}",
        host in "[a-z0-9.:\\[\\]%-]{0,16}",
        path in "[a-z0-9/,.%*-]{0,12}",
        query in "(([a-z_]{0,10})=([a-z0-9:/.\\[\\]%&=-]{0,24}))?",
    ) {
        // Near-valid URLs reach deeper into the parsers than arbitrary text does.
        let text = format!("{scheme}://{user}@{host}/{path}?{query}");
        let _ = BackendUrl::parse("--store", &text);
        let text = format!("{scheme}://{path}?{query}");
        let _ = BackendUrl::parse("--store", &text);
    }
}

#[test]
fn dynamodb_streams_urls_name_the_table_or_the_stream() {
    // dynamodb-streams:// is a source: the table's stream, or the one ?stream= names.
    let arn = "arn:aws:dynamodb:eu-west-1:123456789012:table/orders/stream/2024-01-01T00:00:00.000";
    assert!(matches!(
        BackendUrl::source("--source", "dynamodb-streams://orders?endpoint=http://127.0.0.1:8000").expect("valid"),
        BackendUrl::DynamodbStreams(AwsUrl { ref name, stream: None, endpoint: Some(_), .. }) if name == "orders"
    ));
    match BackendUrl::source(
        "--source",
        &format!("dynamodb-streams://orders?stream={arn}"),
    ) {
        Ok(BackendUrl::DynamodbStreams(aws)) => assert_eq!(aws.stream.as_deref(), Some(arn)),
        other => panic!("a stream ARN, got {other:?}"),
    }
    let err = BackendUrl::store("--store", "dynamodb-streams://orders").expect_err("a source");
    assert!(
        err.to_string()
            .contains("dynamodb-streams:// is a feed source"),
        "{err}"
    );
    let err = BackendUrl::source("--source", "dynamodb-streams://orders?stream=orders")
        .expect_err("not an ARN");
    assert!(err.to_string().contains("parameter stream"), "{err}");
    let err =
        BackendUrl::source("--source", "kinesis://s?stream=x").expect_err("kinesis has no stream=");
    assert!(err.to_string().contains("kinesis://"), "{err}");
    assert_eq!(
        BackendUrl::source(
            "--source",
            "dynamodb-streams://orders?endpoint=http://127.0.0.1:8000"
        )
        .expect("valid")
        .redacted(),
        "dynamodb-streams://orders?endpoint=http://127.0.0.1:8000"
    );
}

#[test]
fn a_dynamodb_streams_record_shape_is_plain_or_adapter_and_named_when_wrong() {
    use changefeed_dynamodb::RecordShape;
    let shape = |text: &str| match BackendUrl::source("--source", text) {
        Ok(BackendUrl::DynamodbStreams(aws)) => aws.record,
        other => panic!("a dynamodb-streams source, got {other:?}"),
    };
    assert_eq!(shape("dynamodb-streams://orders"), None);
    assert_eq!(
        shape("dynamodb-streams://orders?record=plain"),
        Some(RecordShape::Plain)
    );
    assert_eq!(
        shape("dynamodb-streams://orders?record=adapter&region=us-east-1"),
        Some(RecordShape::Adapter)
    );
    let err = BackendUrl::source("--source", "dynamodb-streams://orders?record=typed")
        .expect_err("no such shape");
    let text = err.to_string();
    assert!(text.starts_with("--source: "), "{text}");
    assert!(
        text.contains("parameter record: \"typed\" must be plain"),
        "{text}"
    );
    let err = BackendUrl::source("--source", "kinesis://orders?record=adapter")
        .expect_err("kinesis has no record=");
    assert!(err.to_string().contains("kinesis:// accepts only"), "{err}");
    let err = BackendUrl::source("--source", "dynamodb-streams://orders?recrod=adapter")
        .expect_err("misspelt");
    assert!(err.to_string().contains("?record=plain|adapter"), "{err}");
}

#[test]
fn kinesis_retrieval_is_fan_out_with_a_consumer_or_polling() {
    // ?retrieval=fanout&consumer=NAME reads by enhanced fan-out; polling is the default; a
    // half-given or bad choice is refused naming the parameter.
    let fanout = |url: &str| match BackendUrl::source("--source", url) {
        Ok(BackendUrl::Kinesis(aws)) => Ok(aws.retrieval),
        Ok(other) => panic!("not kinesis: {other:?}"),
        Err(e) => Err(e.0),
    };
    assert_eq!(
        fanout("kinesis://orders?retrieval=fanout&consumer=app-1"),
        Ok(changefeed_kinesis::Retrieval::FanOut {
            consumer_name: "app-1".into()
        })
    );
    assert_eq!(
        fanout("kinesis://orders?retrieval=polling"),
        Ok(changefeed_kinesis::Retrieval::Polling)
    );
    assert_eq!(
        fanout("kinesis://orders"),
        Ok(changefeed_kinesis::Retrieval::Polling)
    );
    for (url, names) in [
        ("kinesis://orders?retrieval=fanout", "consumer=NAME"),
        ("kinesis://orders?consumer=app", "retrieval=fanout"),
        ("kinesis://orders?retrieval=push", "parameter retrieval"),
        (
            "kinesis://orders?retrieval=fanout&consumer=a/b",
            "parameter consumer",
        ),
    ] {
        let err = fanout(url).expect_err(url);
        assert!(err.contains(names), "{url}: {err}");
    }
    let err =
        BackendUrl::store("--store", "dynamodb://t?retrieval=fanout").expect_err("kinesis only");
    assert!(err.0.contains("retrieval=fanout"), "{}", err.0);
}
