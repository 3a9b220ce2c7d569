//! [`ForwardingStore`]: the one delegation every [`LeaseStore`] wrapper shares.
//!
//! A wrapper (counting calls, cutting a host off in a test, injecting faults in the simulator)
//! changes what happens around a few calls and passes every other call on unchanged. It
//! implements [`ForwardingStore`] instead of [`LeaseStore`]: [`ForwardingStore::inner`] names
//! the wrapped store, [`ForwardingStore::before`] runs before each call (and may refuse it),
//! and any method it does not override forwards to the inner store. Every [`ForwardingStore`]
//! is a [`LeaseStore`].
//!
//! Both traits have the same method names, so a call like `wrapper.list(…)` is ambiguous where
//! both are in scope: name [`ForwardingStore`] by its path in the `impl`, and keep only
//! [`LeaseStore`] imported where the wrapper is used.

use crate::lease::HeartbeatRole;
use async_trait::async_trait;

use super::{Changes, LeaseStore, Listing, MembershipStore};
use crate::error::LeaseError;
use crate::model::{
    GroupHead, GroupName, Heartbeat, HostName, Lease, LeaseKey, Membership, MembershipView,
    Timestamp, Version,
};

/// Writes [`StoreOp`], [`ForwardingStore`] and the [`LeaseStore`] and [`MembershipStore`]
/// impls of every [`ForwardingStore`] from one table of their methods, so each signature is
/// written once.
macro_rules! forwarding {
    (
        leases { $($op:ident => $name:ident($($arg:ident: $ty:ty),*) -> $ret:ty;)* }
        members { $($mop:ident => $mname:ident($($marg:ident: $mty:ty),*) -> $mret:ty;)* }
    ) => {
        /// A [`LeaseStore`] call, as [`ForwardingStore::before`] sees it.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        #[non_exhaustive]
        pub enum StoreOp {
            $(
                #[doc = concat!("[`LeaseStore::", stringify!($name), "`].")]
                $op,
            )*
            $(
                #[doc = concat!("[`MembershipStore::", stringify!($mname), "`].")]
                $mop,
            )*
        }

        impl StoreOp {
            /// The method's name (`list`, `replace` …), as [`LeaseError::Store`] names an
            /// operation.
            pub fn as_str(self) -> &'static str {
                match self {
                    $(StoreOp::$op => stringify!($name),)*
                    $(StoreOp::$mop => stringify!($mname),)*
                }
            }
        }

        /// A [`LeaseStore`] that wraps another: every call it does not override goes to
        /// [`ForwardingStore::inner`] after [`ForwardingStore::before`]. Implement this instead
        /// of [`LeaseStore`] (which every implementor gets) and override only what differs; an
        /// override that still calls the inner store calls `before` itself if it wants it.
        #[async_trait]
        pub trait ForwardingStore: Send + Sync + std::fmt::Debug {
            /// The wrapped store.
            fn inner(&self) -> &dyn LeaseStore;

            /// Runs before each forwarded call; an error is returned instead of making the
            /// call. Does nothing by default.
            ///
            /// # Errors
            /// Whatever the wrapper wants the caller to see instead of the call's result.
            async fn before(&self, op: StoreOp) -> Result<(), LeaseError> {
                let _ = op;
                Ok(())
            }

            /// [`MembershipStore::head_reads_per_second`] of [`ForwardingStore::inner`].
            fn head_reads_per_second(&self) -> Option<f64> {
                self.inner().head_reads_per_second()
            }

            $(
                #[doc = concat!(
                    "[`LeaseStore::", stringify!($name), "`] on [`ForwardingStore::inner`], ",
                    "after [`ForwardingStore::before`].\n\n# Errors\n",
                    "Those of [`ForwardingStore::before`] and of the inner store."
                )]
                async fn $name(&self, $($arg: $ty),*) -> Result<$ret, LeaseError> {
                    self.before(StoreOp::$op).await?;
                    self.inner().$name($($arg),*).await
                }
            )*

            $(
                #[doc = concat!(
                    "[`MembershipStore::", stringify!($mname), "`] on [`ForwardingStore::inner`], ",
                    "after [`ForwardingStore::before`].\n\n# Errors\n",
                    "Those of [`ForwardingStore::before`] and of the inner store."
                )]
                // A heartbeat's fields are its arguments; a struct would only rename them.
                #[allow(clippy::too_many_arguments)]
                async fn $mname(&self, $($marg: $mty),*) -> Result<$mret, LeaseError> {
                    self.before(StoreOp::$mop).await?;
                    self.inner().$mname($($marg),*).await
                }
            )*
        }

        #[async_trait]
        impl<T: ForwardingStore> LeaseStore for T {
            $(
                async fn $name(&self, $($arg: $ty),*) -> Result<$ret, LeaseError> {
                    ForwardingStore::$name(self, $($arg),*).await
                }
            )*
        }

        #[async_trait]
        impl<T: ForwardingStore> MembershipStore for T {
            fn head_reads_per_second(&self) -> Option<f64> {
                ForwardingStore::head_reads_per_second(self)
            }

            $(
                async fn $mname(&self, $($marg: $mty),*) -> Result<$mret, LeaseError> {
                    ForwardingStore::$mname(self, $($marg),*).await
                }
            )*
        }
    };
}

forwarding! {
    leases {
        List => list(group: &GroupName) -> Listing;
        Get => get(key: &LeaseKey) -> Option<Lease>;
        Create => create(lease: &Lease) -> Option<Lease>;
        Replace => replace(lease: &Lease, expected: Version) -> Lease;
        Delete => delete(key: &LeaseKey, expected: Version) -> ();
        ListChanges => list_changes(group: &GroupName, since: u64) -> Option<Changes>;
    }
    members {
        Heartbeat => heartbeat(
            group: &GroupName,
            host: &HostName,
            incarnation: &str,
            written_at: Timestamp,
            expected: Option<Version>,
            role: HeartbeatRole,
            report: Option<&str>
        ) -> Heartbeat;
        RemoveHeartbeat => remove_heartbeat(
            group: &GroupName,
            host: &HostName,
            incarnation: &str,
            expected: Version
        ) -> ();
        Membership => membership(group: &GroupName) -> Membership;
        Head => head(group: &GroupName) -> Option<GroupHead>;
        WriteView => write_view(group: &GroupName, view: &MembershipView, expected: u64) -> MembershipView;
    }
}

impl StoreOp {
    /// Whether the call writes (`create`, `replace`, `delete`, `heartbeat`,
    /// `remove_heartbeat`, `write_view`) rather than reads.
    pub fn is_write(self) -> bool {
        matches!(
            self,
            StoreOp::Create
                | StoreOp::Replace
                | StoreOp::Delete
                | StoreOp::Heartbeat
                | StoreOp::RemoveHeartbeat
                | StoreOp::WriteView
        )
    }
}
