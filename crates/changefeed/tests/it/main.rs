//! Integration tests of the core crate: one binary, one module per area.

mod conformance;
mod processor;
