// `send_receipt`: charge an order through a payment service and email its
// receipt through an email service, each once, however often the task is
// retried or redelivered and however many tasks carry the same order.
//
// The JavaScript twin of `examples/send_receipt`: same payloads, results,
// requests and operation keys. Payload → result:
//
//     {"order_id": "A-1", "amount_cents": 1999, "email": "ada@example.com",
//      "payment_url": "http://127.0.0.1:8081", "email_url": "http://127.0.0.1:8082"}
//       →  {"order_id": "A-1", "charge_id": "ch_1", "receipt_sent": true}                  (first run)
//       →  {"order_id": "A-1", "charge_id": "ch_1", "receipt_sent": true, "deduped": true}  (later runs)
//
// `email` is optional (`customer-of-<order_id>@example.com`). The handler
// sends `POST {payment_url}/charges` inside the idempotent operation
// `charge:<order_id>` and `POST {email_url}/emails` inside
// `receipt:<order_id>`, each once per order (24 h). The operator must allow
// both services' hosts (`allow_hosts`, or `--allow-host send_receipt=PATTERN`).

import { FatalError, http, idempotentOperation, storedResult, task } from 'dtq';

/** How long an order's claims keep later runs from repeating its effects. */
const DAY_SECONDS = 86_400;

function field(order, name, type) {
  const value = order?.[name];
  if (typeof value !== type) {
    throw new FatalError(`payload does not match the handler's type: field \`${name}\``);
  }
  return value;
}

task('send_receipt', async (order) => {
  const orderId = field(order, 'order_id', 'string');
  const amountCents = field(order, 'amount_cents', 'number');
  const paymentUrl = field(order, 'payment_url', 'string');
  const emailUrl = field(order, 'email_url', 'string');
  const email = order.email ?? `customer-of-${orderId}@example.com`;

  const chargeKey = `charge:${orderId}`;
  let [charged, charge] = await idempotentOperation(chargeKey, DAY_SECONDS, async () => {
    const body = { order_id: orderId, amount_cents: amountCents };
    const reply = (await http.postJson(`${paymentUrl}/charges`, body)).errorForStatus().json();
    // What the operation stores: the charge, as the Rust handler keeps it.
    return { charge_id: reply.charge_id };
  });
  // Charged before: by an earlier attempt that failed after it, or by
  // another task with the same order. Its result is kept with the claim.
  if (charge === null) {
    charge = storedResult(chargeKey);
    if (charge === null) throw new FatalError(`${chargeKey} is done but kept no charge`);
  }

  await idempotentOperation(`receipt:${orderId}`, DAY_SECONDS, async () => {
    const receipt = {
      to: email,
      subject: `Your receipt for order ${orderId}`,
      order_id: orderId,
      charge_id: charge.charge_id,
      amount_cents: amountCents,
    };
    (await http.postJson(`${emailUrl}/emails`, receipt)).errorForStatus();
  });

  const result = { order_id: orderId, charge_id: charge.charge_id, receipt_sent: true };
  if (!charged) result.deduped = true;
  return result;
});
