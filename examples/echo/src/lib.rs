//! `echo`: return the payload unchanged.
//!
//! Payload → result: any JSON value `X` → the same `X`, byte for byte.
//!
//! The payload is taken as [`RawJson`], so it is neither parsed nor
//! re-serialized: a call costs little more than the trip into and out of the
//! sandbox, which makes this the handler to measure that trip with.

use dtq_guest::{Context, RawJson, Result};

fn echo(_ctx: Context, payload: RawJson) -> Result<RawJson> {
    Ok(payload)
}

dtq_guest::handler!(echo);
