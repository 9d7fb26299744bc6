//! `send_receipt`: charge an order through a payment service and email its
//! receipt through an email service, each once, however often the task is
//! retried or redelivered and however many tasks carry the same order.
//!
//! Payload → result:
//!
//! ```text
//! {"order_id": "A-1", "amount_cents": 1999, "email": "ada@example.com",
//!  "payment_url": "http://127.0.0.1:8081", "email_url": "http://127.0.0.1:8082"}
//!     →  {"order_id": "A-1", "charge_id": "ch_1", "receipt_sent": true}                    (first run)
//!     →  {"order_id": "A-1", "charge_id": "ch_1", "receipt_sent": true, "deduped": true}    (every later run)
//! ```
//!
//! `email` is optional (`customer-of-<order_id>@example.com`). The handler
//! sends:
//!
//! - `POST {payment_url}/charges` with `{"order_id", "amount_cents"}`, inside
//!   the idempotent operation `charge:<order_id>`, and expects a 2xx answer
//!   with `{"charge_id"}`;
//! - `POST {email_url}/emails` with `{"to", "subject", "order_id",
//!   "charge_id", "amount_cents"}`, inside the operation `receipt:<order_id>`.
//!
//! Each operation runs its request once per order (24 h). If an attempt
//! dies after the POST and before the operation commits, the next attempt
//! runs it again, and the host sends the same `Idempotency-Key` as the first
//! time: a service that honours the header (the payment service should)
//! does not act twice. The operator must allow both services' hosts (the
//! deploy setting `allow_hosts`, or `--allow-host send_receipt=PATTERN`).

use dtq_guest::{Context, Error, Result, http, idempotent_operation, stored_result};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

/// How long an order's claims keep later runs from repeating its effects.
const DAY_SECONDS: u32 = 86_400;

#[derive(Deserialize)]
struct Order {
    order_id: String,
    amount_cents: u64,
    email: Option<String>,
    payment_url: String,
    email_url: String,
}

/// What the payment service answers, and the charge operation stores.
#[derive(Serialize, Deserialize)]
struct Charge {
    charge_id: String,
}

fn send_receipt(_ctx: Context, order: Order) -> Result<Value> {
    let id = &order.order_id;
    let charge_key = format!("charge:{id}");
    let (charged, charge) = idempotent_operation(&charge_key, DAY_SECONDS, || {
        let body = json!({"order_id": id, "amount_cents": order.amount_cents});
        http::post_json(format!("{}/charges", order.payment_url), &body)?
            .error_for_status()?
            .json::<Charge>()
    })?;
    // Charged before: by an earlier attempt that failed after it, or by
    // another task with the same order. Its result is kept with the claim.
    let charge = match charge {
        Some(charge) => charge,
        None => stored_result(&charge_key)?
            .ok_or_else(|| Error::fatal(format!("{charge_key} is done but kept no charge")))?,
    };

    idempotent_operation(format!("receipt:{id}"), DAY_SECONDS, || {
        let to = order
            .email
            .clone()
            .unwrap_or(format!("customer-of-{id}@example.com"));
        let receipt = json!({
            "to": to,
            "subject": format!("Your receipt for order {id}"),
            "order_id": id,
            "charge_id": charge.charge_id,
            "amount_cents": order.amount_cents,
        });
        http::post_json(format!("{}/emails", order.email_url), &receipt)?.error_for_status()?;
        Ok(())
    })?;

    let mut result = json!({"order_id": id, "charge_id": charge.charge_id, "receipt_sent": true});
    if !charged {
        result["deduped"] = json!(true);
    }
    Ok(result)
}

dtq_guest::handler!(send_receipt);
