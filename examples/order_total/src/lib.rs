//! `order_total`: price an order: per-line and grand totals in integer cents.
//!
//! Payload → result:
//!
//! ```text
//! {
//!   "lines": [
//!     {"sku": "TEA-1", "quantity": 3, "unit_price_cents": 450, "tax_rate_bp": 700},
//!     {"sku": "MUG-2", "quantity": 1, "unit_price_cents": 1299}
//!   ],
//!   "shipping_cents": 500
//! }
//! →
//! {
//!   "lines": [
//!     {"sku": "TEA-1", "quantity": 3, "subtotal_cents": 1350, "tax_cents": 95, "total_cents": 1445},
//!     {"sku": "MUG-2", "quantity": 1, "subtotal_cents": 1299, "tax_cents": 0, "total_cents": 1299}
//!   ],
//!   "item_count": 4,
//!   "subtotal_cents": 2649,
//!   "tax_cents": 95,
//!   "shipping_cents": 500,
//!   "total_cents": 3244
//! }
//! ```
//!
//! * `tax_rate_bp` is the line's tax rate in basis points (700 = 7 %),
//!   0 to 10 000, default 0. A line's tax is `subtotal × rate / 10 000`,
//!   rounded half up to a whole cent; `shipping_cents` (default 0) is untaxed.
//! * All amounts are integers: money never passes through floating point.
//!
//! Invalid input is a fatal error, since the same order would fail again: no
//! lines or more than [`MAX_LINES`], an empty `sku`, a `quantity` below 1, a
//! negative price or shipping, a tax rate out of range, or totals too large
//! for 64 bits.

use dtq_guest::{Context, Error, Result};
use serde::{Deserialize, Serialize};

/// The most lines one order may have.
pub const MAX_LINES: usize = 1_000;

/// One basis point is a hundredth of a percent.
const BASIS_POINTS_PER_UNIT: i128 = 10_000;

#[derive(Deserialize)]
struct Order {
    lines: Vec<Line>,
    #[serde(default)]
    shipping_cents: i64,
}

#[derive(Deserialize)]
struct Line {
    sku: String,
    quantity: i64,
    unit_price_cents: i64,
    #[serde(default)]
    tax_rate_bp: i64,
}

#[derive(Serialize)]
struct Totals {
    lines: Vec<LineTotal>,
    item_count: i64,
    subtotal_cents: i64,
    tax_cents: i64,
    shipping_cents: i64,
    total_cents: i64,
}

#[derive(Serialize)]
struct LineTotal {
    sku: String,
    quantity: i64,
    subtotal_cents: i64,
    tax_cents: i64,
    total_cents: i64,
}

fn order_total(_ctx: Context, order: Order) -> Result<Totals> {
    if order.lines.is_empty() {
        dtq_guest::fatal!("an order needs at least one line");
    }
    if order.lines.len() > MAX_LINES {
        dtq_guest::fatal!(
            "an order may have at most {MAX_LINES} lines, got {}",
            order.lines.len()
        );
    }
    if order.shipping_cents < 0 {
        dtq_guest::fatal!(
            "shipping_cents must not be negative, got {}",
            order.shipping_cents
        );
    }

    let mut totals = Totals {
        lines: Vec::with_capacity(order.lines.len()),
        item_count: 0,
        subtotal_cents: 0,
        tax_cents: 0,
        shipping_cents: order.shipping_cents,
        total_cents: 0,
    };
    for (index, line) in order.lines.into_iter().enumerate() {
        let line = price_line(line).map_err(|e| e.context(format!("line {index}")))?;
        totals.item_count = add(totals.item_count, line.quantity)?;
        totals.subtotal_cents = add(totals.subtotal_cents, line.subtotal_cents)?;
        totals.tax_cents = add(totals.tax_cents, line.tax_cents)?;
        totals.lines.push(line);
    }
    totals.total_cents = add(
        add(totals.subtotal_cents, totals.tax_cents)?,
        totals.shipping_cents,
    )?;
    Ok(totals)
}

fn price_line(line: Line) -> Result<LineTotal> {
    if line.sku.trim().is_empty() {
        dtq_guest::fatal!("sku must not be empty");
    }
    if line.quantity < 1 {
        dtq_guest::fatal!(
            "quantity of {} must be at least 1, got {}",
            line.sku,
            line.quantity
        );
    }
    if line.unit_price_cents < 0 {
        dtq_guest::fatal!(
            "unit_price_cents of {} must not be negative, got {}",
            line.sku,
            line.unit_price_cents
        );
    }
    if !(0..=10_000).contains(&line.tax_rate_bp) {
        dtq_guest::fatal!(
            "tax_rate_bp of {} must be between 0 and 10000, got {}",
            line.sku,
            line.tax_rate_bp
        );
    }

    let subtotal = line
        .quantity
        .checked_mul(line.unit_price_cents)
        .ok_or_else(too_large)?;
    // Round half up: add half the divisor before the (non-negative) division.
    let tax = (i128::from(subtotal) * i128::from(line.tax_rate_bp) + BASIS_POINTS_PER_UNIT / 2)
        / BASIS_POINTS_PER_UNIT;
    let tax = i64::try_from(tax).map_err(|_| too_large())?;
    Ok(LineTotal {
        total_cents: add(subtotal, tax)?,
        sku: line.sku,
        quantity: line.quantity,
        subtotal_cents: subtotal,
        tax_cents: tax,
    })
}

fn add(a: i64, b: i64) -> Result<i64> {
    a.checked_add(b).ok_or_else(too_large)
}

fn too_large() -> Error {
    Error::fatal("order totals are too large to compute in cents")
}

dtq_guest::handler!(order_total);
