//! The keys a KCL 2.x/3.x MultiLangDaemon properties file may hold, and what `run` makes of
//! each: used, accepted as having no meaning here, or unknown (refused when it is a near
//! miss of a known key, warned about otherwise).

/// The keys `run` reads (see the table of [`super`]).
pub(super) const USED: [&str; 16] = [
    "executableName",
    "streamName",
    "streamArn",
    "applicationName",
    "kinesisEndpoint",
    "dynamoDBEndpoint",
    "regionName",
    "initialPositionInStream",
    "initialPositionInStreamExtended",
    "maxRecords",
    "idleTimeBetweenReadsInMillis",
    "failoverTimeMillis",
    "shardSyncIntervalMillis",
    "workerId",
    "retrievalMode",
    "consumerName",
];

/// The keys of the KCL 2.x/3.x daemon (`MultiLangDaemonConfiguration` and the KCL 3.x
/// `sample.properties`) that have no meaning here: credentials come from the standard AWS
/// chain, there is no CloudWatch, and the lease table and balancing are ours.
const NOT_APPLICABLE: [&str; 66] = [
    // The child's language, for the KCL's user agent.
    "processingLanguage",
    "AWSCredentialsProvider",
    "AWSCredentialsProviderDynamoDB",
    "AWSCredentialsProviderCloudWatch",
    "tableName",
    "enablePriorityLeaseAssignment",
    "cleanupLeasesUponShardCompletion",
    "ignoreUnexpectedChildShards",
    "maxLeasesForWorker",
    "maxLeasesToStealAtOneTime",
    "initialLeaseTableReadCapacity",
    "initialLeaseTableWriteCapacity",
    "maxLeaseRenewalThreads",
    "listShardsBackoffTimeInMillis",
    "maxListShardsRetryAttempts",
    "callProcessRecordsEvenForEmptyRecordList",
    "parentShardPollIntervalMillis",
    "shardPrioritization",
    "skipShardSyncAtWorkerInitializationIfLeasesExist",
    "schedulerInitializationBackoffTimeMillis",
    "taskBackoffTimeMillis",
    "metricsBufferTimeMillis",
    "metricsMaxQueueSize",
    "metricsLevel",
    "metricsEnabledDimensions",
    "logWarningForTaskAfterMillis",
    "validateSequenceNumberBeforeCheckpointing",
    "shutdownGraceMillis",
    "timeoutInSeconds",
    "maxActiveThreads",
    "retryGetRecordsInSeconds",
    "maxGetRecordsThreadPool",
    "consumerArn",
    "leaseTableDeletionProtectionEnabled",
    "leaseTablePitrEnabled",
    "billingMode",
    "clientVersionConfig",
    "coordinatorStateTableName",
    "coordinatorStateBillingMode",
    "coordinatorStateReadCapacity",
    "coordinatorStateWriteCapacity",
    "coordinatorStatePointInTimeRecoveryEnabled",
    "coordinatorStateDeletionProtectionEnabled",
    "coordinatorStateTags",
    "gracefulLeaseHandoffTimeoutMillis",
    "isGracefulLeaseHandoffEnabled",
    "workerMetricsTableName",
    "workerMetricsBillingMode",
    "workerMetricsReadCapacity",
    "workerMetricsWriteCapacity",
    "workerMetricsPointInTimeRecoveryEnabled",
    "workerMetricsDeletionProtectionEnabled",
    "workerMetricsTags",
    "inMemoryWorkerMetricsCaptureFrequencyMillis",
    "workerMetricsReporterFreqInMillis",
    "noOfPersistedMetricsPerWorkerMetrics",
    "disableWorkerMetrics",
    "maxThroughputPerHostKBps",
    "dampeningPercentage",
    "reBalanceThresholdPercentage",
    "allowThroughputOvershoot",
    "staleWorkerMetricsEntryCleanupDuration",
    "varianceBalancingFrequency",
    "workerMetricsEMAAlpha",
    "lowerUtilizationThresholdPercentage",
    "upperUtilizationThresholdPercentage",
];

/// The daemon's nested settings (`kinesisClient.endpointOverride = …`): the part before the
/// first dot. None has a meaning here.
const NESTED: [&str; 5] = [
    "kinesisClient",
    "dynamoDbClient",
    "cloudWatchClient",
    "fanoutConfig",
    "pollingConfig",
];

/// What a key of the file is.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Key {
    /// Read by `run`, under this spelling.
    Used(&'static str),
    /// A KCL key with no meaning here.
    NotApplicable,
    /// Not a KCL key, with the closest known key if it is a near miss of one.
    Unknown { near: Option<&'static str> },
}

/// The key the KCL reads for `key`: it matches the credentials-provider keys in any case
/// (`KinesisClientLibConfigurator.processKey`: `AWSCredentialsProvider`,
/// `awsCredentialsProvider` … are one key) and every other key exactly.
fn canonical(key: &str) -> std::borrow::Cow<'_, str> {
    const PREFIX: &str = "AWSCredentialsProvider";
    match key.get(..PREFIX.len()) {
        Some(head) if head.eq_ignore_ascii_case(PREFIX) && head != PREFIX => {
            format!("{PREFIX}{}", &key[PREFIX.len()..]).into()
        }
        _ => key.into(),
    }
}

/// Classifies one key of the file.
pub(super) fn classify(key: &str) -> Key {
    let key = canonical(key);
    if let Some(used) = USED.iter().find(|k| **k == key) {
        return Key::Used(used);
    }
    if NOT_APPLICABLE.contains(&key.as_ref()) {
        return Key::NotApplicable;
    }
    if let Some((head, _)) = key.split_once('.') {
        if NESTED.contains(&head) {
            return Key::NotApplicable;
        }
    }
    Key::Unknown { near: near(&key) }
}

/// The known key `key` is a near miss of: a case slip, a transposition, or up to two letters
/// wrong (one for a short key), by Damerau-Levenshtein distance ignoring case.
fn near(key: &str) -> Option<&'static str> {
    let lower = key.to_ascii_lowercase();
    let limit = if key.len() < 8 { 1 } else { 2 };
    USED.iter()
        .chain(NOT_APPLICABLE.iter())
        .map(|k| {
            (
                strsim::damerau_levenshtein(&lower, &k.to_ascii_lowercase()),
                *k,
            )
        })
        .filter(|(d, _)| *d <= limit)
        .min_by_key(|(d, _)| *d)
        .map(|(_, k)| k)
}

/// The known key closest to `key`, however far: named beside an unknown key.
pub(super) fn closest(key: &str) -> &'static str {
    let lower = key.to_ascii_lowercase();
    USED.iter()
        .chain(NOT_APPLICABLE.iter())
        .min_by_key(|k| strsim::damerau_levenshtein(&lower, &k.to_ascii_lowercase()))
        .copied()
        .unwrap_or(USED[0])
}
