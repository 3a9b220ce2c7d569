use super::*;
use crate::config::RunArgs;

/// Reads `text` and fills `args` from it, as `run --properties` does.
fn apply(args: &mut RunArgs, name: &str, text: &str) -> Result<Notes, UsageError> {
    Ok(args.fill_from(read(name, text)?))
}

const FILE: &str = "\
# The sample.properties of amazon-kinesis-client-python, trimmed
executableName = python3 sample_kclpy_app.py
streamName=orders
applicationName: orders-app
processingLanguage = python/3.11
initialPositionInStream = TRIM_HORIZON
AWSCredentialsProvider = DefaultCredentialsProvider
regionName = us-east-1
kinesisEndpoint = http://127.0.0.1:4568
dynamoDBEndpoint = http://127.0.0.1:8000
maxRecords = 500
idleTimeBetweenReadsInMillis \\
= 250
failoverTimeMillis = 10000
";

#[test]
fn a_kcl_properties_file_fills_the_run_settings() {
    let mut args = RunArgs::default();
    apply(&mut args, "app.properties", FILE).expect("valid");
    assert_eq!(args.handler.as_deref(), Some("python3 sample_kclpy_app.py"));
    assert_eq!(
        args.source.as_deref(),
        Some("kinesis://orders?endpoint=http://127.0.0.1:4568&region=us-east-1")
    );
    assert_eq!(
        args.store.as_deref(),
        Some("dynamodb://orders-app?endpoint=http://127.0.0.1:8000&region=us-east-1")
    );
    assert_eq!(args.group.as_deref(), Some("orders-app"));
    assert_eq!(args.start_position.as_deref(), Some("beginning"));
    assert_eq!(args.max_batch_size.as_deref(), Some("500"));
    assert_eq!(args.poll_delay.as_deref(), Some("250ms"));
    assert_eq!(args.lease_expiry.as_deref(), Some("10000ms"));
}

/// The start position `apply` makes of `FILE` with `lines` appended.
fn start(lines: &str) -> Result<Option<String>, String> {
    let mut args = RunArgs::default();
    apply(&mut args, "a.properties", &format!("{FILE}{lines}"))
        .map(|_| args.start_position)
        .map_err(|e| e.to_string())
}

#[test]
fn the_start_time_is_read_as_the_kcl_reads_it() {
    // The KCL 2.5.8 MultiLangDaemon reads initialPositionInStreamExtended as whole seconds
    // since the epoch (AT_TIMESTAMP at that second), upper-cases initialPositionInStream,
    // and lets the later of the two lines win.
    assert_eq!(
        start("initialPositionInStreamExtended = 1636609142\n"),
        Ok(Some("at:1636609142000".into()))
    );
    assert_eq!(
        start("initialPositionInStreamExtended = -5\n"),
        Ok(Some("at:-5000".into()))
    );
    assert_eq!(
        start("initialPositionInStream = latest\n"),
        Ok(Some("now".into()))
    );
    let time_then_position =
        "initialPositionInStreamExtended = 1636609142\ninitialPositionInStream = LATEST\n";
    assert_eq!(start(time_then_position), Ok(Some("now".into())));
    let with_at =
        "initialPositionInStream = AT_TIMESTAMP\ninitialPositionInStreamExtended = 1636609142\n";
    assert_eq!(start(with_at), Ok(Some("at:1636609142000".into())));
    let at_first =
        "initialPositionInStreamExtended = 1636609142\ninitialPositionInStream = AT_TIMESTAMP\n";
    assert_eq!(start(at_first), Ok(Some("at:1636609142000".into())));
}

#[test]
fn a_bad_start_time_names_the_property() {
    for bad in [
        "2021-11-11T05:39:02Z",
        "1636609142.5",
        "",
        "99999999999999999999",
    ] {
        let err =
            start(&format!("initialPositionInStreamExtended = {bad}\n")).expect_err("not seconds");
        assert_eq!(
            err,
            format!("properties file a.properties: initialPositionInStreamExtended: \"{bad}\" is not a time: the KCL reads whole seconds since the epoch (e.g. 1636609142)")
        );
    }
    let err = start("initialPositionInStream = AT_TIMESTAMP\n").expect_err("no time");
    assert!(
        err.contains("initialPositionInStream: AT_TIMESTAMP needs the time in initialPositionInStreamExtended"),
        "{err}"
    );
}

#[test]
fn flags_win_and_bad_properties_are_named() {
    let mut args = RunArgs {
        group: Some("mine".into()),
        ..RunArgs::default()
    };
    apply(&mut args, "a.properties", FILE).expect("valid");
    assert_eq!(args.group.as_deref(), Some("mine"));
    let err = apply(&mut RunArgs::default(), "a.properties", "streamName = s\n")
        .expect_err("no executable");
    assert_eq!(
        err.to_string(),
        "properties file a.properties: executableName: is required (the KCL needs it too)"
    );
    let text = format!("{FILE}initialPositionInStream = SOMEWHERE\n");
    let err = apply(&mut RunArgs::default(), "a.properties", &text).expect_err("position");
    assert!(
        err.to_string()
            .contains("initialPositionInStream: \"SOMEWHERE\""),
        "{err}"
    );
    let text = format!("{FILE}failoverTimeMillis = soon\n");
    let err = apply(&mut RunArgs::default(), "a.properties", &text).expect_err("millis");
    assert!(
        err.to_string().contains("failoverTimeMillis: \"soon\""),
        "{err}"
    );
}

/// `apply` on `text`: the settings filled, or the error.
fn applied(text: &str) -> Result<(RunArgs, Notes), String> {
    let mut args = RunArgs::default();
    apply(&mut args, "a.properties", text)
        .map(|notes| (args, notes))
        .map_err(|e| e.to_string())
}

const BASE: &str = "executableName = python3 app.py\napplicationName = app\n";

#[test]
fn a_stream_arn_gives_the_stream_and_its_region_and_wins_over_stream_name() {
    // The KCL reads streamArn first: the stream name comes from the ARN (streamName may be
    // left out), and the stream's region from it too.
    let arn = "streamArn = arn:aws:kinesis:eu-west-1:123456789012:stream/orders\n";
    let (args, notes) = applied(&format!("{BASE}{arn}")).expect("valid");
    assert_eq!(
        args.source.as_deref(),
        Some("kinesis://orders?region=eu-west-1")
    );
    assert_eq!(args.store.as_deref(), Some("dynamodb://app"));
    assert_eq!(
        notes.arn,
        Some(("orders".into(), "eu-west-1".into(), "123456789012".into()))
    );
    // The same stream in both, with the same region: fine.
    let both = format!("{BASE}{arn}streamName = orders\nregionName = eu-west-1\n");
    let (args, _) = applied(&both).expect("valid");
    assert_eq!(
        args.source.as_deref(),
        Some("kinesis://orders?region=eu-west-1")
    );
    assert_eq!(
        args.store.as_deref(),
        Some("dynamodb://app?region=eu-west-1")
    );
}

#[test]
fn a_stream_arn_beside_another_stream_or_region_is_refused_naming_both() {
    let arn = "streamArn = arn:aws:kinesis:eu-west-1:123456789012:stream/orders\n";
    let err = applied(&format!("{BASE}{arn}streamName = payments\n")).expect_err("two streams");
    assert_eq!(
        err,
        "properties file a.properties: streamArn: names stream \"orders\" but streamName names \"payments\": give one, or the same stream in both"
    );
    let err = applied(&format!("{BASE}{arn}regionName = us-east-1\n")).expect_err("two regions");
    assert!(
        err.starts_with("properties file a.properties: streamArn: names a stream in region eu-west-1 but regionName is us-east-1"),
        "{err}"
    );
}

#[test]
fn a_malformed_stream_arn_names_the_property() {
    for (bad, why) in [
        ("orders", "is not a stream ARN"),
        (
            "arn:aws:sqs:eu-west-1:123456789012:stream/orders",
            "the service must be kinesis",
        ),
        (
            "arn:aws:kinesis::123456789012:stream/orders",
            "the region must be",
        ),
        (
            "arn:aws:kinesis:eu-west-1:1234:stream/orders",
            "the account must be 12 digits",
        ),
        (
            "arn:aws:kinesis:eu-west-1:123456789012:table/orders",
            "the resource must be stream/NAME",
        ),
        (
            "arn:aws:kinesis:eu-west-1:123456789012:stream/",
            "the resource must be stream/NAME",
        ),
        (
            "nra:aws:kinesis:eu-west-1:123456789012:stream/orders",
            "must start with arn:aws",
        ),
    ] {
        let err = applied(&format!("{BASE}streamArn = {bad}\n")).expect_err(bad);
        assert!(
            err.starts_with("properties file a.properties: streamArn: ") && err.contains(why),
            "{bad}: {err}"
        );
    }
    let err = applied(BASE).expect_err("no stream");
    assert_eq!(
        err,
        "properties file a.properties: streamName: is required, or streamArn (the KCL needs one of them too)"
    );
}

#[test]
fn every_key_of_the_kcl_sample_is_recognised_and_a_misspelt_one_is_refused() {
    // The keys of the KCL 3.x sample.properties (amazon-kinesis-client-python), both spellings
    // of the credentials provider the KCL accepts, and a nested client setting: none refused
    // or warned about; those with no meaning here are listed.
    let sample = "\
streamArn = arn:aws:kinesis:us-east-1:000000000000:stream/kclpysample
streamName = kclpysample
AwsCredentialsProvider = DefaultCredentialsProvider
awsCredentialsProvider = DefaultCredentialsProvider
AWSCredentialsProviderDynamoDB = DefaultCredentialsProvider
processingLanguage = python/3.8
initialPositionInStream = TRIM_HORIZON
regionName = us-east-1
failoverTimeMillis = 10000
workerId = w1
shardSyncIntervalMillis = 60000
maxRecords = 10000
idleTimeBetweenReadsInMillis = 1000
callProcessRecordsEvenForEmptyRecordList = false
parentShardPollIntervalMillis = 10000
cleanupLeasesUponShardCompletion = true
taskBackoffTimeMillis = 500
metricsBufferTimeMillis = 10000
metricsMaxQueueSize = 10000
validateSequenceNumberBeforeCheckpointing = true
maxActiveThreads = -1
clientVersionConfig = CLIENT_VERSION_CONFIG_3X
coordinatorStateTableName = t
coordinatorStateBillingMode = PAY_PER_REQUEST
coordinatorStateReadCapacity = 1
coordinatorStateWriteCapacity = 1
coordinatorStatePointInTimeRecoveryEnabled = false
coordinatorStateDeletionProtectionEnabled = false
coordinatorStateTags = a=b
gracefulLeaseHandoffTimeoutMillis = 30000
isGracefulLeaseHandoffEnabled = true
workerMetricsTableName = w
workerMetricsBillingMode = PAY_PER_REQUEST
workerMetricsReadCapacity = 1
workerMetricsWriteCapacity = 1
workerMetricsPointInTimeRecoveryEnabled = false
workerMetricsDeletionProtectionEnabled = false
workerMetricsTags = a=b
inMemoryWorkerMetricsCaptureFrequencyMillis = 1000
workerMetricsReporterFreqInMillis = 30000
noOfPersistedMetricsPerWorkerMetrics = 10
disableWorkerMetrics = false
maxThroughputPerHostKBps = 10000
dampeningPercentage = 60
reBalanceThresholdPercentage = 10
allowThroughputOvershoot = true
staleWorkerMetricsEntryCleanupDuration = PT24H
varianceBalancingFrequency = 3
workerMetricsEMAAlpha = 0.5
kinesisClient.endpointOverride = http://127.0.0.1:4568
";
    let (_, notes) = applied(&format!("{BASE}{sample}")).expect("valid");
    assert!(notes.unknown.is_empty(), "{:?}", notes.unknown);
    for key in [
        "AwsCredentialsProvider",
        "awsCredentialsProvider",
        "AWSCredentialsProviderDynamoDB",
        "clientVersionConfig",
        "workerMetricsEMAAlpha",
        "kinesisClient.endpointOverride",
    ] {
        assert!(
            notes.not_applicable.iter().any(|k| k == key),
            "{key}: {:?}",
            notes.not_applicable
        );
    }
    assert!(
        !notes.not_applicable.iter().any(|k| k == "maxRecords"),
        "a used key is not listed"
    );
    // A misspelt key of either kind is refused, naming the key meant; a key the KCL does not
    // know at all is warned about with the closest known key.
    for (typo, meant) in [
        ("kinesisEndpiont", "kinesisEndpoint"),
        ("dynamoDbEndpoint", "dynamoDBEndpoint"),
        ("streamname", "streamName"),
        ("failoverTimeMilis", "failoverTimeMillis"),
        ("metricsLevle", "metricsLevel"),
    ] {
        let err = applied(&format!("{BASE}streamName = s\n{typo} = x\n")).expect_err(typo);
        assert_eq!(
            err,
            format!("properties file a.properties: {typo}: not a KCL property; did you mean {meant}? (the KCL would ignore it and use its default: fix the key, or remove it)")
        );
    }
    let (_, notes) =
        applied(&format!("{BASE}streamName = s\nmyTeamOwner = data\n")).expect("a warning");
    assert_eq!(notes.unknown.len(), 1, "{:?}", notes.unknown);
    assert_eq!(notes.unknown[0].0, "myTeamOwner");
}

#[test]
fn a_store_or_source_flag_keeps_the_files_endpoint_and_region_unless_it_names_its_own() {
    let file = format!(
        "{BASE}streamName = s\nregionName = eu-west-1\nkinesisEndpoint = http://127.0.0.1:4568\n\
         dynamoDBEndpoint = http://127.0.0.1:8000\n"
    );
    let mut args = RunArgs {
        store: Some("dynamodb://other-table".into()),
        source: Some("kinesis://other-stream?region=us-west-2".into()),
        ..RunArgs::default()
    };
    apply(&mut args, "a.properties", &file).expect("valid");
    assert_eq!(
        args.store.as_deref(),
        Some("dynamodb://other-table?endpoint=http://127.0.0.1:8000&region=eu-west-1")
    );
    assert_eq!(
        args.source.as_deref(),
        Some("kinesis://other-stream?region=us-west-2&endpoint=http://127.0.0.1:4568"),
        "a region of its own is kept"
    );
    let mut args = RunArgs {
        store: Some("dynamodb://t?endpoint=http://127.0.0.1:9000&connect_timeout=2s".into()),
        source: Some("sqlite:///tmp/feed.db".into()),
        ..RunArgs::default()
    };
    apply(&mut args, "a.properties", &file).expect("valid");
    assert_eq!(
        args.store.as_deref(),
        Some("dynamodb://t?endpoint=http://127.0.0.1:9000&connect_timeout=2s&region=eu-west-1")
    );
    assert_eq!(
        args.source.as_deref(),
        Some("sqlite:///tmp/feed.db"),
        "another kind of source is left alone"
    );
}

#[test]
fn a_dynamodb_stream_arn_makes_the_source_the_tables_stream() {
    // The DynamoDB Streams adapter's daemon takes the table's stream ARN as streamName: the
    // source is that stream, read at the file's Kinesis endpoint (where the adapter's client
    // stands in for the Kinesis client) in the file's region, else the ARN's.
    let arn = "arn:aws:dynamodb:eu-west-1:123456789012:table/orders/stream/2024-01-01T00:00:00.000";
    for key in ["streamName", "streamArn"] {
        let text = format!("{BASE}{key} = {arn}\nkinesisEndpoint = http://127.0.0.1:8000\n");
        let (args, _) = applied(&text).expect("valid");
        assert_eq!(
            args.source,
            Some(format!(
                "dynamodb-streams://orders?stream={arn}&endpoint=http://127.0.0.1:8000&region=eu-west-1"
            )),
            "{key}"
        );
        let url = crate::url::BackendUrl::source("source", args.source.as_deref().unwrap_or(""));
        assert!(
            matches!(url, Ok(crate::url::BackendUrl::DynamodbStreams(ref aws)) if aws.stream.as_deref() == Some(arn)),
            "{url:?}"
        );
    }
    // regionName, when given, is the client's region, as in the adapter.
    let (args, _) = applied(&format!(
        "{BASE}streamName = {arn}\nregionName = us-east-1\n"
    ))
    .expect("valid");
    assert_eq!(
        args.source,
        Some(format!(
            "dynamodb-streams://orders?stream={arn}&region=us-east-1"
        ))
    );
    let err = applied(&format!(
        "{BASE}streamName = arn:aws:dynamodb:eu-west-1:123456789012:table/orders\n"
    ))
    .expect_err("no stream label");
    assert!(
        err.starts_with("properties file a.properties: streamName: \"arn:aws:dynamodb:eu-west-1:123456789012:table/orders\" is not a DynamoDB stream ARN"),
        "{err}"
    );
    // A --source flag still wins over the file's stream.
    let mut args = RunArgs {
        source: Some("sqlite://feed.db".into()),
        ..RunArgs::default()
    };
    apply(
        &mut args,
        "a.properties",
        &format!("{BASE}streamName = {arn}\n"),
    )
    .expect("valid");
    assert_eq!(args.source.as_deref(), Some("sqlite://feed.db"));
}

#[test]
fn retrieval_mode_chooses_fan_out_or_polling_and_its_absence_is_reported() {
    // FANOUT reads by enhanced fan-out with the application's name as the consumer (as the
    // KCL does), consumerName overriding it; POLLING polls; absent, we poll and say so.
    let (args, notes) = applied(&format!("{FILE}retrievalMode = FANOUT\n")).expect("valid");
    assert_eq!(
        args.source.as_deref(),
        Some("kinesis://orders?endpoint=http://127.0.0.1:4568&region=us-east-1&retrieval=fanout&consumer=orders-app")
    );
    assert!(!notes.retrieval_default);
    let (args, _) = applied(&format!(
        "{FILE}retrievalMode = fanout\nconsumerName = orders-efo\n"
    ))
    .expect("valid");
    assert!(args
        .source
        .as_deref()
        .is_some_and(|s| s.ends_with("&retrieval=fanout&consumer=orders-efo")));
    let (args, notes) = applied(&format!("{FILE}retrievalMode = POLLING\n")).expect("valid");
    assert_eq!(
        args.source.as_deref(),
        Some("kinesis://orders?endpoint=http://127.0.0.1:4568&region=us-east-1")
    );
    assert!(!notes.retrieval_default);
    let (_, notes) = applied(FILE).expect("valid");
    assert!(
        notes.retrieval_default,
        "no retrievalMode: polling, reported"
    );
    let err = applied(&format!("{FILE}retrievalMode = PUSH\n")).expect_err("bad mode");
    assert!(
        err.contains("retrievalMode") && err.contains("FANOUT or POLLING"),
        "{err}"
    );
}
