//! `sleep`: keep the CPU busy for a while, as a slow handler would.
//!
//! Payload → result:
//!
//! ```text
//! {"ms": 250}   →   {"slept_ms": 250}
//! ```
//!
//! It spins on the monotonic clock instead of sleeping, so the call stays
//! inside guest code the whole time: the host's deadline and cancellation must
//! interrupt running code, not a blocked syscall.

use std::time::{Duration, Instant};

use dtq_guest::{Context, Result};
use serde::{Deserialize, Serialize};

#[derive(Deserialize)]
struct Payload {
    ms: u64,
}

#[derive(Serialize)]
struct Slept {
    slept_ms: u64,
}

fn sleep(_ctx: Context, payload: Payload) -> Result<Slept> {
    let until = Duration::from_millis(payload.ms);
    let start = Instant::now();
    while start.elapsed() < until {
        std::hint::spin_loop();
    }
    Ok(Slept {
        slept_ms: payload.ms,
    })
}

dtq_guest::handler!(sleep);
