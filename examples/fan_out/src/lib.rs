//! `fan_out`: a parent task that fans out to one `square` child per number,
//! waits for them, and returns the sum of their results (flows).
//!
//! ```text
//! {"numbers": [1, 2, 3]}                  →  {"sum_of_squares": 14}
//! {"numbers": [1, 2, 3], "queue": "math"}    (the children's queue; default "default")
//! ```
//!
//! The first run finds no children: it submits them and returns
//! `Err(wait_for_children())`, so the task goes WAITING, holding no slot.
//! Once every child has ended, the task runs again (the same attempt) and
//! reads their results. The submissions are applied with the first run's
//! end, exactly once: a run that fails before it returns submits nothing,
//! and a run again after a crash submits the same children (their keys
//! derive from this task and their position).
//!
//! The operator grants the submissions: `dtq deploy --submit-to
//! default:square` (or the worker's `--submit-to fan_out=default:square`).
//! The Python and JavaScript twins are `examples/python/fan_out` and
//! `examples/js/fan_out`.

use dtq_guest::{Context, Error, Result, tasks};
use serde::Deserialize;
use serde_json::{Value, json};

#[derive(Deserialize)]
struct Numbers {
    numbers: Vec<i64>,
    #[serde(default = "default_queue")]
    queue: String,
}

fn default_queue() -> String {
    "default".into()
}

fn fan_out(_ctx: Context, payload: Numbers) -> Result<Value> {
    let children = tasks::children()?;
    if children.is_empty() && !payload.numbers.is_empty() {
        for n in &payload.numbers {
            tasks::Submit::new(&payload.queue, "square", &json!({ "n": n }))?
                .child()
                .send()?;
        }
        return Err(tasks::wait_for_children());
    }
    let mut sum = 0;
    for child in &children {
        // A child that failed is reported to the parent, which decides:
        // here, the whole sum fails.
        let square = child.result.as_ref().and_then(Value::as_i64).ok_or_else(|| {
            Error::fatal(format!(
                "child {} ended {}: {}",
                child.task_id,
                child.status,
                child.error.as_deref().unwrap_or("no result")
            ))
        })?;
        sum += square;
    }
    Ok(json!({ "sum_of_squares": sum }))
}

dtq_guest::handler!(fan_out);
