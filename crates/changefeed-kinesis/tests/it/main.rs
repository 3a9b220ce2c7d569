//! Kinesis tests.
