//! Conformance suites every backend runs against its real server (feature `testkit`).
//!
//! One public async function per seam: [`lease_store_conformance`] and
//! [`feed_source_conformance`]. A backend's own tests call them with a fixture factory; the
//! in-memory implementations run them first. Backend differences go in through the fixture
//! traits, never by forking the suite. A check that fails panics with a message naming it.
//!
//! [`net`] holds [`net::FaultProxy`], a loopback TCP proxy that black-holes, resets, delays or
//! refuses one client's connections, for tests that fault the network below the client.
//!
//! [`fleet`] holds the one fleet harness ([`fleet::Fleet`]: processors started, crashed and
//! stopped by name on one store and feed), which the simulator builds on too, and the
//! processor's fleet scenarios, which every backend runs: each takes a store factory and a
//! [`fleet::Timing`] (paused tokio time, or real time with short timings for a store on a
//! server), the one backend difference they admit.

mod feed;
pub mod fleet;
pub mod net;
mod store;
mod view;

pub use feed::{feed_source_conformance, FeedFixture};
pub use store::{lease_store_conformance, Corruption, LeaseStoreFixture};
