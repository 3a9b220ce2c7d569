//! What the benchmarks share with the tests: the fault scenarios of `changefeed-bench faults`
//! ([`faults`]), which the CLI's tests run too.

pub mod faults;
