//! `versioned_v2`: version 2 of the handler of `versioned_v1`, the same
//! code reporting `"version": "v2"`.
//!
//! Payload → result:
//!
//! ```text
//! {"sleep_ms": 3000, "n": 7}   →   {"version": "v2", "n": 7}
//! ```

/// What the result reports as the version that ran.
const VERSION: &str = "v2";

include!("../../versioned_v1/src/handler.rs");
