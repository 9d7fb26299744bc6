//! `waiter`: a handler that waits without working, as one waiting on a
//! slow dependency does, for the benchmark that holds thousands of calls in
//! flight at once.
//!
//! Payload → result:
//!
//! ```text
//! {"ms": 20000}   →   {"waited_ms": 20000}
//! ```
//!
//! It sleeps on a WASI clock subscription (`std::thread::sleep`), which the
//! host serves with a timer: the call is live, holding its instance, memory
//! and stack, and takes no CPU.

use std::time::Duration;

use dtq_guest::{Context, Result};
use serde::{Deserialize, Serialize};

#[derive(Deserialize)]
struct Payload {
    ms: u64,
}

#[derive(Serialize)]
struct Waited {
    waited_ms: u64,
}

fn wait(_ctx: Context, payload: Payload) -> Result<Waited> {
    std::thread::sleep(Duration::from_millis(payload.ms));
    Ok(Waited {
        waited_ms: payload.ms,
    })
}

dtq_guest::handler!(wait);
