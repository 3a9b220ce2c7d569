//! What the library's metrics mean, for the recorder a service installs.

/// Registers the help text and units of the library's metrics (`docs/metrics.md`) with the
/// metrics recorder installed now; each shows up in a scrape from its first event. Call it once,
/// after installing a recorder: the library installs none.
pub fn describe_metrics() {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_counter!(
        "changefeed_batches_total",
        "Batches the handler accepted, by group."
    );
    describe_counter!(
        "changefeed_records_total",
        "Records in batches the handler accepted, by group."
    );
    describe_counter!(
        "changefeed_handler_errors_total",
        "Handler calls that failed (the batch is retried), by group."
    );
    describe_counter!(
        "changefeed_source_errors_total",
        "Feed source reads or opens that failed, by group."
    );
    describe_counter!(
        "changefeed_leases_taken_total",
        "Free or expired leases this host took, by group."
    );
    describe_counter!(
        "changefeed_leases_stolen_total",
        "Leases this host took from a live owner after an unhonoured hand-off, by group."
    );
    describe_counter!(
        "changefeed_leases_lost_total",
        "Leases this host's workers found owned by someone else, by group."
    );
    describe_counter!(
        "changefeed_handoffs_requested_total",
        "Hand-off requests this host wrote, by group."
    );
    describe_counter!(
        "changefeed_handoffs_given_total",
        "Leases this host handed to the host that asked, by group."
    );
    describe_counter!(
        "changefeed_fenced_total",
        "Times this host fenced itself because its heartbeat stopped succeeding."
    );
    describe_counter!(
        "changefeed_store_reads_total",
        "Lease store reads, by operation."
    );
    describe_counter!(
        "changefeed_store_lease_rows_read_total",
        "Lease rows returned by store reads, by operation."
    );
    describe_counter!(
        "changefeed_store_heartbeat_rows_read_total",
        "Heartbeat rows returned by membership reads."
    );
    describe_counter!(
        "changefeed_store_writes_total",
        "Lease store writes, by operation."
    );
    describe_gauge!(
        "changefeed_leases_owned",
        "Leases this host owns now, by group."
    );
    describe_gauge!(
        "changefeed_malformed_leases",
        "Unreadable lease rows in the last listing, by group."
    );
    describe_gauge!(
        "changefeed_unhealthy_since_seconds",
        "When this host's unbroken spell of being fenced or unregistered began (Unix seconds), once it has lasted longer than max_unhealthy; 0 while healthy."
    );
    describe_histogram!(
        "changefeed_checkpoint_seconds",
        Unit::Seconds,
        "Time to write one checkpoint."
    );
}
