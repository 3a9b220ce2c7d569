//! Integration tests of the `changefeed` binary: one test binary, one module per command.

mod plan;
