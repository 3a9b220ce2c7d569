//! Integration tests for the SQLite backend: the core's conformance suites on a real file,
//! and focused checks of what the suites leave to the backend (connections racing, schema
//! versions, rows edited by hand).

// A failed unwrap in a test is a failed test with its cause: that is what we want here.
#![allow(clippy::unwrap_used)]

mod changes;
mod dead_letter;
mod feed;
mod processor;
mod store;
