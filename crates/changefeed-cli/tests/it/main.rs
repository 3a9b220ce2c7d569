//! Integration tests of the `changefeed` binary: one test binary, one module per command.

mod bad_input;
mod console;
mod cosmos;
mod cosmos_import;
mod demo;
mod faults;
mod faults_cosmos;
mod faults_dynamodb;
mod faults_kinesis;
mod feed;
mod fence;
mod health;
mod import_kcl;
mod kcl;
mod lag_seconds;
mod lineage;
mod lines;
mod modules;
mod ops;
mod pg_failure;
mod plan;
mod postgres;
mod run;
mod simulate;
mod start;
mod support;
