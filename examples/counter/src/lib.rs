//! `counter`: add to a named counter kept in the handler's Redis namespace.
//!
//! Payload → result:
//!
//! ```text
//! {"name": "visits", "by": 5}   →   {"name": "visits", "value": 12}
//! ```
//!
//! `by` is optional (default 1) and may be negative. The counter lives at the
//! kv key `counter:<name>`; the result holds its value after the increment.

use dtq_guest::{Context, Result, kv};
use serde::{Deserialize, Serialize};

#[derive(Deserialize)]
struct Payload {
    name: String,
    #[serde(default = "one")]
    by: i64,
}

#[derive(Serialize)]
struct Counted {
    name: String,
    value: i64,
}

fn one() -> i64 {
    1
}

fn count(_ctx: Context, payload: Payload) -> Result<Counted> {
    let value = kv::incr_by(format!("counter:{}", payload.name), payload.by)?;
    Ok(Counted {
        name: payload.name,
        value,
    })
}

dtq_guest::handler!(count);
