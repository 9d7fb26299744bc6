//! `send_receipt`: charge an order and email its receipt at most once, however
//! often the task is retried or redelivered.
//!
//! Payload → result:
//!
//! ```text
//! {"order_id": "A-1", "amount_cents": 1999}   →   {"charged": true, "order_id": "A-1"}   (first run)
//!                                             →   {"deduped": true}                       (every later run)
//! ```
//!
//! The effect runs under [`dtq_guest::idempotent_operation`] with the key
//! `receipt:<order_id>` (TTL 24 h). The charge is simulated by incrementing
//! the kv key `charges:<order_id>`, the email by writing a JSON record to
//! `emails:<order_id>`; `charges:<order_id>` stays at 1 across redeliveries.

use dtq_guest::{Context, Result, idempotent_operation, kv};
use serde::Deserialize;
use serde_json::{Value, json};

/// How long a receipt's claim keeps later runs from repeating it.
const RECEIPT_TTL_SECONDS: u32 = 86_400;

#[derive(Deserialize)]
struct Order {
    order_id: String,
    amount_cents: u64,
}

fn send_receipt(ctx: Context, order: Order) -> Result<Value> {
    let id = &order.order_id;
    let (executed, _) = idempotent_operation(format!("receipt:{id}"), RECEIPT_TTL_SECONDS, || {
        kv::incr(format!("charges:{id}"))?;
        let email = json!({
            "to": format!("customer-of-{id}@example.com"),
            "subject": format!("Your receipt for order {id}"),
            "order_id": id,
            "amount_cents": order.amount_cents,
            "task_id": ctx.task_id,
        });
        kv::set(format!("emails:{id}"), email.to_string())
    })?;
    Ok(if executed {
        json!({"charged": true, "order_id": id})
    } else {
        json!({"deduped": true})
    })
}

dtq_guest::handler!(send_receipt);
