//! Integration tests for the SQLite backend: the core's conformance suites and fleet scenarios
//! on a real file, and focused checks of what the suites leave to the backend (connections
//! racing, schema versions and their migrations, rows edited by hand).

// A failed unwrap in a test is a failed test with its cause: that is what we want here.
#![allow(clippy::unwrap_used)]

mod change_stamps;
mod dead_letter;
mod feed;
mod key_parallel;
mod load_report;
mod processor;
mod store;
