//! Building an AWS SDK configuration: shared with the other AWS backend through
//! `changefeed-aws`.

pub use changefeed_aws::{AwsOptions, Timeouts};
