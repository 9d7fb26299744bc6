//! `waiter_raw`: `waiter` without serde, for the benchmark that holds
//! thousands of calls in flight at once.
//!
//! Payload → result:
//!
//! ```text
//! 20000   →   20000
//! ```
//!
//! The payload is the wait in milliseconds, a bare JSON number, taken as
//! the SDK's `RawJson` and read with `str::parse`. Without `serde_json`
//! the component's data image is about 3 KiB (one page) where `waiter`'s
//! is about 15 KiB. Each instance maps that image, so this is a handler
//! whose own memory per call is as small as a Rust handler's gets, which
//! leaves the host's share of a call to be measured.

use std::time::Duration;

use dtq_guest::{Context, Error, RawJson, Result};

fn wait(_ctx: Context, payload: RawJson) -> Result<RawJson> {
    let ms: u64 = payload
        .0
        .trim()
        .parse()
        .map_err(|_| Error::fatal("the payload must be a wait in milliseconds"))?;
    std::thread::sleep(Duration::from_millis(ms));
    Ok(RawJson(ms.to_string()))
}

dtq_guest::handler!(wait);
