//! `square`: the child of `fan_out`: `{"n": 3}` → `9`.

use dtq_guest::{Context, Result};
use serde::Deserialize;

#[derive(Deserialize)]
struct Number {
    n: i64,
}

fn square(_ctx: Context, payload: Number) -> Result<i64> {
    payload
        .n
        .checked_mul(payload.n)
        .ok_or_else(|| dtq_guest::Error::fatal(format!("{}² does not fit in 64 bits", payload.n)))
}

dtq_guest::handler!(square);
