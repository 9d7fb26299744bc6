//! `waiter`: a handler that waits without working, as one waiting on a
//! slow dependency does, for the benchmark that holds thousands of calls in
//! flight at once.
//!
//! Payload → result:
//!
//! ```text
//! {"ms": 20000}                      →   {"waited_ms": 20000}
//! {"ms": 20000, "touch_kib": 512}    →   {"waited_ms": 20000}
//! ```
//!
//! With `touch_kib` it first writes that much of its heap and holds it
//! while it waits, as a handler holding a working set would.
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
    #[serde(default)]
    touch_kib: usize,
}

#[derive(Serialize)]
struct Waited {
    waited_ms: u64,
}

fn wait(_ctx: Context, payload: Payload) -> Result<Waited> {
    let held = vec![1u8; payload.touch_kib << 10];
    std::thread::sleep(Duration::from_millis(payload.ms));
    drop(std::hint::black_box(held));
    Ok(Waited {
        waited_ms: payload.ms,
    })
}

dtq_guest::handler!(wait);
