//! `flaky`: fail with a retryable error until a given attempt, then succeed.
//!
//! Payload → result:
//!
//! ```text
//! {"succeed_on_attempt": 3}   →   retryable error on attempts 1 and 2
//!                             →   {"attempt": 3} on attempt 3 (and any later one)
//! ```
//!
//! With `succeed_on_attempt` above the task's attempt limit it never succeeds,
//! which exercises retries and dead-lettering.

use dtq_guest::{Context, Result};
use serde::{Deserialize, Serialize};

#[derive(Deserialize)]
struct Payload {
    succeed_on_attempt: u32,
}

#[derive(Serialize)]
struct Succeeded {
    attempt: u32,
}

fn flaky(ctx: Context, payload: Payload) -> Result<Succeeded> {
    if ctx.attempt < payload.succeed_on_attempt {
        dtq_guest::retry!(
            "attempt {} of {} fails on purpose; attempt {} will succeed",
            ctx.attempt,
            ctx.max_attempts,
            payload.succeed_on_attempt
        );
    }
    Ok(Succeeded {
        attempt: ctx.attempt,
    })
}

dtq_guest::handler!(flaky);
