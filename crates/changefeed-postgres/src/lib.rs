//! PostgreSQL lease store and transactional-outbox feed source for changefeed.
//!
//! [`PostgresLeaseStore`] implements the core's [`LeaseStore`](changefeed::lease::LeaseStore)
//! and [`PostgresOutbox`] its [`FeedSource`](changefeed::source::FeedSource) over an outbox
//! table that applications fill with [`append`] inside their own transactions. This crate
//! owns its tables (all named `{prefix}_…`, created on first connect and versioned in
//! `{prefix}_schema_versions`) and the mapping of rows to the core's model; the lease
//! protocol, balancing and lineage stay in the core.
//!
//! # Why tokio-postgres + deadpool + rustls
//!
//! The lease store runs a handful of fixed statements, each one round trip, and the outbox's
//! [`append`] must run in the **application's** transaction. `tokio-postgres` is the thin
//! async driver whose `Transaction` applications already hold (it is what `deadpool-postgres`
//! and most frameworks hand out), so [`append`] can take one; sqlx would force its own
//! transaction type on the application and brings a query layer, macros and compile-time
//! checking we do not use. `deadpool-postgres` adds a small pool with a prepared-statement
//! cache per connection. TLS goes through `rustls` (pure Rust with the `ring` provider: no
//! system OpenSSL to match) via `tokio-postgres-rustls`; see [`PgOptions`] for `sslmode`.
//!
//! # Timeouts and errors
//!
//! Every connection runs with `statement_timeout` (default 5 s), and every call is bounded on
//! the client as well (default 7 s), so a hung server or network becomes a retryable
//! [`LeaseError::Store`](changefeed::LeaseError::Store), never a stuck host. Connection
//! failures, timeouts, serialization failures and deadlocks are retryable; see
//! [`PostgresError::is_retryable`], the one place that decides.
//!
//! # From the command line
//!
//! The `changefeed` binary names these as `--store postgres://USER@HOST/DB?prefix=P` and
//! `--source postgres-outbox://USER@HOST/DB?prefix=P`, and `changefeed outbox create
//! --partitions N` / `append --key K --data D` set up and fill an outbox (see
//! `docs/operations.md`).
//!
//! # Failure test
//!
//! Besides the conformance suites and the in-process fleet tests in this crate's `tests/`,
//! `crates/changefeed-cli/tests/it/pg_failure.rs` runs four `changefeed run` processes on one
//! server (this lease store and an outbox source) with a `psql` shell handler that records
//! every delivery, stamped with the test machine's clock, in a ledger table. While the test
//! appends records in its own transactions, it SIGKILLs hosts, SIGSTOPs one past the lease
//! expiry and SIGCONTs it, restarts hosts, and cuts one host off from the lease store (not
//! from the outbox) with a loopback TCP proxy that stops forwarding. It then checks that every
//! record was delivered, each key's first deliveries are in order, duplicates come only at
//! the start of an ownership run and stay within one batch, and the cut-off host's last
//! delivery of each partition precedes the new owner's first (design rules 1, 3 and 4). With
//! a 3 s lease expiry it takes about 20–30 s: `cargo test -p changefeed-cli --test it
//! pg_failure`.
//!
//! # Example
//!
//! ```no_run
//! use changefeed::lease::LeaseStore;
//! use changefeed::model::{GroupName, Lease, LeaseKey, Position};
//! use changefeed::source::FeedSource;
//! use changefeed_postgres::{append, OutboxTable, PgOptions, PostgresLeaseStore, PostgresOutbox};
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let url = "postgres://postgres@127.0.0.1:5432/test";
//!
//! // The feed: an outbox of four partitions.
//! let table = OutboxTable::new("shop")?;
//! let outbox = PostgresOutbox::connect(PgOptions::new(url), table.clone()).await?;
//! outbox.create_partitions(4).await?;
//!
//! // The application writes its change and the outbox record in one transaction.
//! let (mut client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls).await?;
//! tokio::spawn(connection);
//! let tx = client.transaction().await?;
//! // … tx.execute("UPDATE orders SET …", &[]) …
//! let written = append(&tx, &table, "order-17", b"created").await?;
//! tx.commit().await?;
//!
//! let mut reader = outbox.open(&written.partition, &Position::Beginning).await?;
//! let batch = reader.next_batch(10).await?;
//!
//! // The leases: creating is create-if-absent.
//! let store = PostgresLeaseStore::connect_with(PgOptions::new(url).prefix("shop")).await?;
//! let key = LeaseKey::new(GroupName::new("orders")?, written.partition);
//! store.create(&Lease::new(key.clone(), Position::Beginning)).await?;
//! # Ok(()) }
//! ```
#![warn(missing_docs)]

mod db;
mod dead_letter;
mod error;
pub mod outbox;
mod store;

pub use db::{validate_prefix, PgOptions, DEFAULT_PREFIX, MAX_PREFIX_LEN};
pub use dead_letter::{PostgresDeadLetters, DEAD_LETTER_SCHEMA_VERSION};
pub use error::PostgresError;
pub use outbox::{append, append_to, Appended, OutboxTable, PostgresOutbox, OUTBOX_SCHEMA_VERSION};
pub use store::{PostgresLeaseStore, DEFAULT_CHANGES_KEPT, LEASE_SCHEMA_VERSION};
