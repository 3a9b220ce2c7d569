//! Integration tests of the core crate: one binary, one module per area.

#![allow(clippy::unwrap_used)]

mod common;
mod conformance;
mod fence;
mod handler;
mod health;
mod limits;
mod lineage;
mod multistream;
mod options;
mod pacing;
mod processor;
mod sim;
mod worker;
