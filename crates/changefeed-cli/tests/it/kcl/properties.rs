//! How `changefeed run --properties FILE` reads the file's keys: `streamArn`, misspelt and
//! unknown keys, and a `--store` beside the file's endpoint.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use super::{delivered, endpoint, kclpy_python, ledger, put, rand_suffix, stream};
use crate::support::{bin, json, read, rt, run_ok, text, wait_for, KillOnDrop, FAST};

#[test]
fn a_stream_arn_alone_names_the_stream_and_a_store_flag_keeps_the_files_endpoint() {
    // The KCL's sample.properties names the stream by streamArn: with no streamName, the
    // records of the ARN's stream are delivered. `--store dynamodb://TABLE` without an
    // endpoint of its own keeps the file's dynamoDBEndpoint: the leases land in that table on
    // the local server, never on real AWS.
    let python = kclpy_python();
    let kinesis = endpoint("CHANGEFEED_TEST_KINESIS_URL");
    let dynamodb = endpoint("CHANGEFEED_TEST_DYNAMODB_URL");
    let unique = format!("kclarn-{}-{}", std::process::id(), rand_suffix());
    let dir = tempfile::tempdir().expect("temporary directory");
    let ledger_path = dir.path().join("ledger.jsonl");
    let properties = sample(dir.path(), &python, &kinesis, &dynamodb, &unique, "");
    let feed = stream(&kinesis, &unique);
    put(&feed, 0..10);
    let table = format!("{unique}-leases");
    let stderr = dir.path().join("stderr");
    let mut host = KillOnDrop(
        bin()
            .args(["run", "--properties"])
            .arg(&properties)
            .args(["--store", &format!("dynamodb://{table}")])
            // The default lease expiry: a fresh table on DynamoDB Local can take longer than
            // the fast settings allow a heartbeat.
            .args(["--acquire-interval", "200ms", "--poll-delay", "50ms"])
            .args(["--host", "a"])
            .env("KCL_TEST_LEDGER", &ledger_path)
            .stdin(Stdio::null())
            .stderr(std::fs::File::create(&stderr).expect("stderr file"))
            .spawn()
            .expect("start changefeed run"),
    );
    let want: BTreeSet<String> = (0..10).map(|i| format!("r-{i}")).collect();
    wait_for(
        Duration::from_secs(90),
        "the ARN's stream delivered",
        || {
            assert!(
                host.0.try_wait().expect("try_wait").is_none(),
                "run exited: {}",
                read(&stderr)
            );
            want.is_subset(&delivered(&ledger(&ledger_path)))
                .then_some(())
        },
    );
    let store = format!("dynamodb://{table}?endpoint={dynamodb}&region=us-east-1");
    let status = json(&run_ok(&[
        "status", "--store", &store, "--group", &unique, "--json",
    ]));
    assert_eq!(
        status["leases"].as_array().map(Vec::len),
        Some(2),
        "both shards' leases in the --store table on the file's endpoint: {status}"
    );
    drop(host);
    let log = read(&stderr);
    assert!(
        log.contains("the stream from streamArn") && log.contains("account=000000000000"),
        "{log}"
    );
    assert!(
        log.contains("KCL properties not applicable here, ignored")
            && log.contains("AwsCredentialsProvider, processingLanguage"),
        "the keys with no meaning here are listed once: {log}"
    );
    rt().block_on(feed.delete_stream()).expect("delete stream");
}

#[test]
fn a_misspelt_key_is_refused_and_an_unknown_one_warned_about() {
    // A near miss of a known key would be ignored by the KCL, silently (a misspelt endpoint
    // key sends the host to real AWS): refused before anything starts, naming both keys. A key
    // the KCL does not know at all is ignored, with a warning naming the closest known key.
    let dir = tempfile::tempdir().expect("temporary directory");
    let properties = dir.path().join("app.properties");
    std::fs::write(
        &properties,
        "executableName = true\nstreamName = s\napplicationName = app\n\
         kinesisEndpiont = http://127.0.0.1:4568\n",
    )
    .expect("write properties");
    let out = bin()
        .args(["run", "--properties"])
        .arg(&properties)
        .output()
        .expect("run");
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(2), "a usage error: {stderr}");
    assert!(
        stderr.contains(&format!(
            "properties file {}: kinesisEndpiont: not a KCL property; did you mean kinesisEndpoint?",
            properties.display()
        )),
        "{stderr}"
    );

    let db = dir.path().join("feed.db");
    run_ok(&["feed", "--db", &db.display().to_string(), "create", "1"]);
    std::fs::write(
        &properties,
        "executableName = cat > /dev/null\nstreamName = s\napplicationName = app\n\
         teamOwnerEmail = data@example.com\n",
    )
    .expect("write properties");
    let url = format!("sqlite://{}", db.display());
    let stderr = dir.path().join("stderr");
    let mut host = KillOnDrop(
        bin()
            .args(["run", "--properties"])
            .arg(&properties)
            .args(["--store", &url, "--source", &url, "--host", "a"])
            .args(FAST)
            .stdin(Stdio::null())
            .stderr(std::fs::File::create(&stderr).expect("stderr file"))
            .spawn()
            .expect("start run"),
    );
    wait_for(Duration::from_secs(20), "the warning", || {
        assert!(
            host.0.try_wait().expect("try_wait").is_none(),
            "run exited: {}",
            read(&stderr)
        );
        let log = read(&stderr);
        (log.contains("not a KCL property, ignored") && log.contains("key=teamOwnerEmail"))
            .then_some(())
    });
}

/// Writes the KCL sample's properties (`streamArn`, local endpoints) and `extra` lines.
fn sample(
    dir: &Path,
    python: &str,
    kinesis: &str,
    dynamodb: &str,
    unique: &str,
    extra: &str,
) -> std::path::PathBuf {
    let processor = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/it/kcl/record_processor.py");
    let properties = dir.join("app.properties");
    std::fs::write(
        &properties,
        format!(
            "executableName = {python} {processor}\n\
             streamArn = arn:aws:kinesis:us-east-1:000000000000:stream/{unique}\n\
             applicationName = {unique}\nAwsCredentialsProvider = DefaultCredentialsProvider\n\
             processingLanguage = python/3\ninitialPositionInStream = TRIM_HORIZON\n\
             regionName = us-east-1\nkinesisEndpoint = {kinesis}\ndynamoDBEndpoint = {dynamodb}\n{extra}",
            processor = processor.display()
        ),
    )
    .expect("write properties");
    properties
}

#[test]
fn retrieval_mode_fanout_reads_through_a_consumer_named_after_the_application() {
    // retrievalMode = FANOUT reads by enhanced fan-out as the KCL does: the records arrive and
    // the stream has a consumer named applicationName. Without retrievalMode we poll, and a
    // warning naming retrievalMode says so.
    let python = kclpy_python();
    let kinesis = endpoint("CHANGEFEED_TEST_KINESIS_URL");
    let dynamodb = endpoint("CHANGEFEED_TEST_DYNAMODB_URL");
    for fanout in [true, false] {
        let unique = format!("kclefo-{}-{}", std::process::id(), rand_suffix());
        let dir = tempfile::tempdir().expect("temporary directory");
        let ledger_path = dir.path().join("ledger.jsonl");
        let extra = if fanout {
            "retrievalMode = FANOUT\n"
        } else {
            ""
        };
        let properties = sample(dir.path(), &python, &kinesis, &dynamodb, &unique, extra);
        let feed = stream(&kinesis, &unique);
        put(&feed, 0..10);
        let stderr = dir.path().join("stderr");
        let mut host = KillOnDrop(
            bin()
                .args(["run", "--properties"])
                .arg(&properties)
                .args(["--acquire-interval", "200ms", "--poll-delay", "50ms"])
                .args(["--host", "a"])
                .env("KCL_TEST_LEDGER", &ledger_path)
                .stdin(Stdio::null())
                .stderr(std::fs::File::create(&stderr).expect("stderr file"))
                .spawn()
                .expect("start changefeed run"),
        );
        let want: BTreeSet<String> = (0..10).map(|i| format!("r-{i}")).collect();
        wait_for(Duration::from_secs(90), "records delivered", || {
            assert!(
                host.0.try_wait().expect("try_wait").is_none(),
                "run exited: {}",
                read(&stderr)
            );
            want.is_subset(&delivered(&ledger(&ledger_path)))
                .then_some(())
        });
        drop(host);
        let consumers = super::stream_consumers(&feed, &unique);
        let log = read(&stderr);
        if fanout {
            assert_eq!(consumers, vec![unique.clone()], "{log}");
            assert!(!log.contains("retrievalMode is not set"), "{log}");
        } else {
            assert!(consumers.is_empty(), "polling registers no consumer");
            assert!(log.contains("retrievalMode is not set"), "{log}");
        }
        rt().block_on(feed.delete_stream()).expect("delete stream");
    }
}
