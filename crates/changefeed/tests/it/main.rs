//! Integration tests of the core crate: one binary, one module per area.

#![allow(clippy::unwrap_used)]

mod conformance;
mod handler;
mod lineage;
mod processor;
mod sim;
