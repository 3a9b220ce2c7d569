//! Amazon Kinesis Data Streams feed source for changefeed.
#![warn(missing_docs)]
