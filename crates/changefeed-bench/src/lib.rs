//! What the benchmarks share with the tests: the fault scenarios of `changefeed-bench faults`
//! ([`faults`]), which the CLI's tests run too, and the reading of a `RESULT` line
//! ([`result`]), which the smoke test of the `--quick` benchmarks checks.

pub mod faults;
pub mod result;
