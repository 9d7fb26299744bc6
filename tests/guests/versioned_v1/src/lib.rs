//! `versioned_v1`: version 1 of one handler, for the tests of deploying a
//! new version to a running fleet (`versioned_v2` is version 2).
//!
//! Payload → result:
//!
//! ```text
//! {"sleep_ms": 3000, "n": 7}   →   {"version": "v1", "n": 7}
//! ```
//!
//! Both fields are optional (`n` defaults to `null`). `sleep_ms` blocks on
//! the monotonic clock rather than spinning, so a test can keep several
//! calls in flight without keeping as many CPUs busy.

/// What the result reports as the version that ran.
const VERSION: &str = "v1";

include!("handler.rs");
