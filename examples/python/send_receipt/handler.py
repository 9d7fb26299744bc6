"""``send_receipt``: charge an order through a payment service and email its
receipt through an email service, each once, however often the task is
retried or redelivered and however many tasks carry the same order.

The Python twin of ``examples/send_receipt``: same payloads, results,
requests and operation keys. Payload → result::

    {"order_id": "A-1", "amount_cents": 1999, "email": "ada@example.com",
     "payment_url": "http://127.0.0.1:8081", "email_url": "http://127.0.0.1:8082"}
        →  {"order_id": "A-1", "charge_id": "ch_1", "receipt_sent": true}                  (first run)
        →  {"order_id": "A-1", "charge_id": "ch_1", "receipt_sent": true, "deduped": true}  (later runs)

``email`` is optional (``customer-of-<order_id>@example.com``). The handler
sends ``POST {payment_url}/charges`` inside the idempotent operation
``charge:<order_id>`` and ``POST {email_url}/emails`` inside
``receipt:<order_id>``, each once per order (24 h). The operator must allow
both services' hosts (``allow_hosts``, or ``--allow-host send_receipt=PATTERN``).
"""

from dtq_guest import FatalError, http, idempotent_operation, stored_result, task

#: How long an order's claims keep later runs from repeating its effects.
DAY_SECONDS = 86_400


def field(order, name, kind):
    value = order.get(name) if isinstance(order, dict) else None
    if not isinstance(value, kind) or isinstance(value, bool):
        raise FatalError(f"payload does not match the handler's type: field `{name}`")
    return value


@task("send_receipt")
def send_receipt(order, ctx):
    order_id = field(order, "order_id", str)
    amount_cents = field(order, "amount_cents", int)
    payment_url = field(order, "payment_url", str)
    email_url = field(order, "email_url", str)
    email = order.get("email")
    if email is None:
        email = f"customer-of-{order_id}@example.com"

    def charge():
        body = {"order_id": order_id, "amount_cents": amount_cents}
        reply = http.post_json(f"{payment_url}/charges", body).error_for_status().json()
        # What the operation stores: the charge, as the Rust handler keeps it.
        return {"charge_id": reply["charge_id"]}

    charge_key = f"charge:{order_id}"
    charged, charge_result = idempotent_operation(charge_key, DAY_SECONDS, charge)
    # Charged before: by an earlier attempt that failed after it, or by
    # another task with the same order. Its result is kept with the claim.
    if charge_result is None:
        charge_result = stored_result(charge_key)
        if charge_result is None:
            raise FatalError(f"{charge_key} is done but kept no charge")
    charge_id = charge_result["charge_id"]

    def receipt():
        http.post_json(
            f"{email_url}/emails",
            {
                "to": email,
                "subject": f"Your receipt for order {order_id}",
                "order_id": order_id,
                "charge_id": charge_id,
                "amount_cents": amount_cents,
            },
        ).error_for_status()

    idempotent_operation(f"receipt:{order_id}", DAY_SECONDS, receipt)

    result = {"order_id": order_id, "charge_id": charge_id, "receipt_sent": True}
    if not charged:
        result["deduped"] = True
    return result
