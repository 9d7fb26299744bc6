//! `dtq submit` (and `--wait`) and `dtq submit-batch`.

use std::time::{Duration, Instant};

use anyhow::Context as _;
use dtq_host::base::ErrorCode;
use dtq_host::client::{Client, ClientError, Submitted};
use dtq_host::ingest::{MAX_BATCH_ITEMS, SubmitRequest, parse_run_at};
use dtq_host::store::TaskStatus;
use serde_json::{Value, json};

use super::args::SubmitArgs;
use super::print::{Format, format, show};
use super::table::View;
use super::{Failure, client, fail};

/// `dtq submit`: print the answer, or with `--wait` the task's record
/// once it ends (exit 4 if it ended otherwise than SUCCEEDED, 5 if it had
/// not ended by `--wait-timeout-s`). With `--wait`, a key whose task is
/// still in flight (409 `IDEMPOTENCY_IN_PROGRESS`) is followed as a replay
/// would be: that task's record is printed. A task left for a worker is
/// warned about on stderr when no live worker consumes its queue.
pub(crate) async fn submit(args: SubmitArgs) -> Result<(), Failure> {
    let request = request(&args)?;
    let api = client(args.client)?;
    let key = args.idempotency_key.as_deref();
    let submitted = match api.submit(&args.queue, &request, key).await {
        Ok(submitted) => submitted,
        Err(e) if args.wait => match in_flight(&e) {
            Some(id) => {
                eprintln!(
                    "dtq: idempotency key {:?} belongs to task {id}, still in flight: \
                     following that task",
                    key.unwrap_or_default()
                );
                in_flight_task(&api, &args.queue, id).await?
            }
            None => return Err(e.into()),
        },
        Err(e) => return Err(e.into()),
    };
    if !submitted.task.status.is_terminal() {
        warn_if_unconsumed(&api, &args.queue).await;
    }
    if !args.wait {
        return show(View::Task, &submitted);
    }
    let id = &submitted.task.task_id;
    let deadline = Instant::now() + Duration::from_secs(args.wait_timeout_s);
    let task = if submitted.task.status.is_terminal() {
        api.task(&args.queue, id).await?
    } else {
        api.wait(&args.queue, id, deadline).await?
    };
    let status = task.status;
    // Whether the submission was a replay is the submit's answer, not the
    // task's.
    show(
        View::Task,
        &Submitted {
            task,
            duplicate: submitted.duplicate,
        },
    )?;
    match status {
        TaskStatus::Succeeded => Ok(()),
        _ if status.is_terminal() => Err(fail(4, anyhow::anyhow!("task {id} ended {status}"))),
        _ => Err(fail(
            5,
            anyhow::anyhow!("task {id} still {status} after {}s", args.wait_timeout_s),
        )),
    }
}

/// The in-flight task a refusal names: a 409 `IDEMPOTENCY_IN_PROGRESS`
/// carries its id in `details.task_id`.
fn in_flight(e: &ClientError) -> Option<&str> {
    match e {
        ClientError::Api { code, details, .. }
            if code == ErrorCode::IdempotencyInProgress.as_str() =>
        {
            details["task_id"].as_str()
        }
        _ => None,
    }
}

/// The in-flight task `id`, as a replay's answer: its record, a duplicate.
async fn in_flight_task(api: &Client, queue: &str, id: &str) -> Result<Submitted, Failure> {
    Ok(Submitted {
        task: api.task(queue, id).await?,
        duplicate: true,
    })
}

/// How long the fleet report may take before the warning is given up.
const FLEET_CHECK: Duration = Duration::from_secs(2);

/// A warning on stderr when no live worker consumes `queue`. The fleet
/// report is a courtesy: when it cannot be read in [`FLEET_CHECK`] (a
/// token without access to it, an older server, a slow one), nothing is
/// said and the submission stands.
async fn warn_if_unconsumed(api: &Client, queue: &str) {
    if let Ok(Ok(workers)) = tokio::time::timeout(FLEET_CHECK, api.consumers(queue)).await
        && workers.is_empty()
    {
        eprintln!(
            "warning: no live worker consumes queue {queue:?}: the task waits until \
             one runs with --queues {queue} (see `dtq handlers` for the fleet)"
        );
    }
}

/// The submission `args` describe; 2 if its payload or `--run-at` cannot
/// be read.
fn request(args: &SubmitArgs) -> Result<SubmitRequest, Failure> {
    let text = match args.payload.as_str() {
        "-" => {
            std::io::read_to_string(std::io::stdin()).context("reading the payload from stdin")?
        }
        p if p.starts_with('@') => std::fs::read_to_string(&p[1..])
            .with_context(|| format!("reading the payload from {}", &p[1..]))?,
        p => p.to_owned(),
    };
    let payload: Value = serde_json::from_str(&text)
        .map_err(|e| fail(2, anyhow::anyhow!("the payload is not JSON: {e}")))?;
    // As the server reads it: ms since the epoch, or an RFC 3339 string.
    let run_at = match &args.run_at {
        Some(at) => {
            let value = at.parse::<u64>().map_or_else(|_| json!(at), |ms| json!(ms));
            Some(parse_run_at(&value).map_err(|e| fail(2, anyhow::anyhow!("--run-at: {e}")))?)
        }
        None => None,
    };
    Ok(SubmitRequest {
        task: args.task.clone(),
        payload,
        idempotency_key: None,
        max_attempts: args.max_attempts,
        timeout_ms: args.timeout_ms,
        delay_ms: args.delay_ms,
        expires_in_ms: args.expires_in_ms,
        run_at,
    })
}

/// `dtq submit-batch`: the lines of `file` (blank ones skipped) in
/// batches of [`MAX_BATCH_ITEMS`]; a line that is not JSON stops it
/// before anything is sent. Each line's result is printed as a JSON line
/// (a line of text on a terminal); 1 if any was refused.
#[allow(clippy::print_stdout)]
pub(crate) async fn submit_batch(api: Client, queue: &str, file: &str) -> Result<(), Failure> {
    let (lines, items) = read_lines(file)?;
    let (mut new, mut replays, mut refused) = (0, 0, 0);
    for (lines, items) in lines
        .chunks(MAX_BATCH_ITEMS)
        .zip(items.chunks(MAX_BATCH_ITEMS))
    {
        let answer = api.submit_batch(queue, items).await?;
        for (line, result) in lines.iter().zip(answer.results) {
            match result.status {
                202 => new += 1,
                200 => replays += 1,
                _ => refused += 1,
            }
            match format() {
                Format::Json => println!(
                    "{}",
                    json!({"line": line, "status": result.status, "body": result.body})
                ),
                Format::Table => println!("{}", batch_line(*line, result.status, &result.body)),
            }
        }
    }
    eprintln!(
        "{} tasks: {new} new, {replays} replays, {refused} refused",
        items.len()
    );
    if refused > 0 {
        return Err(fail(
            1,
            anyhow::anyhow!("{refused} of {} tasks were refused", items.len()),
        ));
    }
    Ok(())
}

/// One line's result for a person: `line 3: new task <id> (QUEUED)`, a
/// replay, or the error.
fn batch_line(line: usize, status: u16, body: &Value) -> String {
    let task = |what: &str| {
        format!(
            "line {line}: {what} {} ({})",
            body["task_id"].as_str().unwrap_or("-"),
            body["status"].as_str().unwrap_or("-")
        )
    };
    match status {
        202 => task("new task"),
        200 => task("replay of task"),
        _ => format!(
            "line {line}: refused, {status} {}: {}",
            body["error"]["code"].as_str().unwrap_or("-"),
            body["error"]["message"].as_str().unwrap_or("-")
        ),
    }
}

/// The items of a file of JSON lines (`-`: stdin), and the line number of
/// each; 2 if a line is not JSON or there is none.
fn read_lines(file: &str) -> Result<(Vec<usize>, Vec<Value>), Failure> {
    let text = match file {
        "-" => std::io::read_to_string(std::io::stdin()).context("reading the tasks from stdin")?,
        f => std::fs::read_to_string(f).with_context(|| format!("reading the tasks from {f}"))?,
    };
    let (mut lines, mut items) = (Vec::new(), Vec::new());
    for (i, line) in text.lines().enumerate() {
        if !line.trim().is_empty() {
            let item: Value = serde_json::from_str(line)
                .map_err(|e| fail(2, anyhow::anyhow!("line {}: not JSON: {e}", i + 1)))?;
            lines.push(i + 1);
            items.push(item);
        }
    }
    if items.is_empty() {
        return Err(fail(2, anyhow::anyhow!("{file} has no tasks")));
    }
    Ok((lines, items))
}
