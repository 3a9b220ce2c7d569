//! Integration tests for the PostgreSQL backend against a real server: the core's conformance
//! suites and fleet scenarios, the outbox gap under concurrent writers, re-partitioning, and
//! what `list_changes` does that is PostgreSQL's own (schema migration, the deletion horizon).
//!
//! The server comes from `CHANGEFEED_TEST_POSTGRES_URL` (default
//! `postgres://postgres@127.0.0.1:5432/test`); `.ci/run` starts one. Every test works on
//! tables with a fresh prefix, so tests run in parallel and leave no shared state.

// A failed unwrap in a test is a failed test with its cause: that is what we want here.
#![allow(clippy::unwrap_used)]

mod change_stamps;
mod common;
mod dead_letter;
mod faults;
mod feed;
mod fleet;
mod store;
