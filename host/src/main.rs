//! The `dtq` command: the server (`serve`, `worker`, `api`) and a client for
//! its HTTP API (`submit`, `submit-batch`, `status`, `tasks`, `watch`, `cancel`, `queues`,
//! `dlq`, `deploy`, `handlers`, `rollback`, `undeploy`).

use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use dtq_host::Config;
use dtq_host::deploy::SigningKeyFile;
use dtq_host::server::{self, Roles, ServerError};
use serde_json::{Value, json};
use tracing::info;

/// mimalloc: a worker allocates and frees a little per task on several
/// threads at once, where glibc's allocator spends noticeably more.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

// Lazy arena commit and no transparent huge pages (`dtq_host::allocator`).
dtq_host::mimalloc_defaults!();

const EXIT_CODES: &str = "\
Exit codes:
  0  success (with --wait: the task SUCCEEDED)
  1  the server refused the request; stderr has its error code and message
  2  bad command line
  3  the server (or Redis) cannot be reached
  4  --wait: the task ended FAILED, DEAD_LETTERED, CANCELLED or EXPIRED
  5  --wait: the task did not finish within --wait-timeout-s";

const SERVER_EXIT_CODES: &str = "\
Exit codes:
  0  stopped by SIGTERM or SIGINT (running tasks finished or were abandoned
     to be reclaimed after --shutdown-grace-ms)
  1  failed while running (e.g. cannot listen on --listen)
  2  bad configuration (a flag, or the --handlers directory)
  3  Redis cannot be reached";

/// dtq: a task queue on Redis whose handlers are WebAssembly components.
///
/// Deploy `<task>.wasm` handlers (built for wasm32-wasip2 against the
/// dtq:handler WIT contract) into a directory, run `dtq serve --handlers DIR`,
/// and submit tasks over HTTP or with `dtq submit`. Every flag of the server
/// commands can also be set by a `DTQ_*` environment variable (the Redis URL
/// by `DTQ_REDIS_URL`, the handlers directory by `DTQ_HANDLERS`, ...); `dtq
/// serve --help` shows each one.
#[derive(Parser)]
#[command(name = "dtq", version, after_help = EXIT_CODES)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the HTTP API and a worker in one process.
    #[command(after_help = SERVER_EXIT_CODES)]
    Serve(Config),
    /// Run a worker only: consume --queues and run their tasks.
    #[command(after_help = SERVER_EXIT_CODES)]
    Worker(Config),
    /// Run the HTTP API only (submissions, status, cancel, DLQ).
    #[command(after_help = SERVER_EXIT_CODES)]
    Api(Config),
    /// Submit a task through the API and print the response.
    #[command(after_help = EXIT_CODES)]
    Submit(SubmitArgs),
    /// Submit the tasks of a file of JSON lines, each line a submission
    /// body (`{"task", "payload", "idempotency_key"?, ...}`), in batches of
    /// 1000: print each line's result as a JSON line (`line`, `status`,
    /// `body`) and a summary on stderr. Exit code 1 if any was refused.
    #[command(after_help = EXIT_CODES)]
    SubmitBatch {
        /// The queue.
        queue: String,
        /// The file of JSON lines, or `-` for stdin.
        file: String,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Show a task: status, attempts, result, error, log, timestamps, and
    /// `attempt_history`: each attempt kept (the last 20), oldest first,
    /// with its outcome, error, log, start, end, duration and digest.
    Status {
        /// The task's queue.
        queue: String,
        /// The task id.
        id: String,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// List a queue's tasks, newest first: one page, and the cursor of the
    /// next (`next_cursor`, null at the end).
    Tasks {
        /// The queue.
        queue: String,
        /// Only tasks of this status (QUEUED, SCHEDULED, RUNNING, RETRYING,
        /// SUCCEEDED, FAILED, DEAD_LETTERED, CANCELLED, EXPIRED).
        #[arg(long)]
        status: Option<String>,
        /// Tasks per page, 1 to 1000 (server default 100).
        #[arg(long)]
        limit: Option<u32>,
        /// Continue after a page: its `next_cursor`.
        #[arg(long)]
        cursor: Option<String>,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Print a queue's events as they happen, one JSON object per line
    /// (`id`, `event`, `task_id`, `status`, `attempt`, `at`), until
    /// interrupted. A dropped connection is resumed where it left off; an
    /// `event: gap` line says events were trimmed before they were read.
    Watch {
        /// The queue.
        queue: String,
        /// Only this task's events.
        #[arg(long)]
        task: Option<String>,
        /// Start after this event id (a line's `id`) instead of with new
        /// events.
        #[arg(long)]
        since: Option<String>,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Cancel a waiting or running task.
    Cancel {
        /// The task's queue.
        queue: String,
        /// The task id.
        id: String,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Show the counts of every queue, or of one.
    Queues {
        /// Only this queue.
        queue: Option<String>,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Raise a queue's partition count (needs `admin` on every queue, e.g.
    /// the admin token).
    ///
    /// A partitioned queue is spread over COUNT Redis Cluster slots, so one
    /// busy queue uses every shard: a keyed submission goes to the
    /// partition of its key, an unkeyed one round-robin, and workers
    /// consume every partition (new ones within 2 s, without a restart).
    /// The count can only be raised. On a single Redis it changes nothing
    /// but the layout.
    Partitions {
        /// The queue.
        queue: String,
        /// The new count, 1 to 256, at least the present one.
        count: u32,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// List, requeue or purge dead-lettered tasks.
    #[command(subcommand)]
    Dlq(DlqCommand),
    /// Set, list or delete a queue's periodic tasks (cron schedules, UTC).
    #[command(subcommand)]
    Schedule(ScheduleCommand),
    /// Deploy a handler module to the fleet (needs a `deploy` grant
    /// covering the task, its namespace and hosts, or the admin token).
    ///
    /// The module is checked first (it compiles, fits the handler world,
    /// its imports are provided, its namespace is granted, some live worker
    /// can honour its settings unless --force), stored in Redis
    /// by its SHA-256, and made the active version of the task. Every API
    /// and worker picks it up without a restart; tasks already running
    /// finish on the version they started with. Then this waits until every
    /// live worker runs it (--wait-s) and prints the rollout.
    #[command(after_help = DEPLOY_HELP)]
    Deploy(DeployArgs),
    /// Show the deployed handlers and what each live worker runs; `history
    /// TASK` shows a task's versions.
    Handlers {
        #[command(subcommand)]
        command: Option<HandlersCommand>,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Make an earlier version of a task's handler active again (needs a
    /// `deploy` grant covering the version it restores, or the admin
    /// token): by default the newest one in its history that differs
    /// from the active one.
    Rollback {
        /// The task.
        task: String,
        /// Return to this digest (see `dtq handlers history TASK`).
        #[arg(long)]
        to: Option<String>,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Write a signing key pair for `dtq deploy --sign-key`: NAME (private,
    /// mode 0600) and NAME.pub (public: add its line to the fleet's
    /// --trusted-keys file). Existing files are not overwritten.
    Keygen {
        /// The private key's path; the public key goes beside it with
        /// `.pub` added, and the key is named by the file's name.
        name: std::path::PathBuf,
    },
    /// Remove a task's handler from the fleet (needs a `deploy` grant
    /// covering the task, or the admin token). New
    /// submissions of the task are refused; waiting ones wait for a deploy.
    /// Its history stays, so `dtq rollback TASK` brings it back.
    Undeploy {
        /// The task.
        task: String,
        #[command(flatten)]
        client: ClientArgs,
    },
}

const DEPLOY_HELP: &str = "\
A manifest deploys several handlers at once; each table names a task, its
module (relative to the manifest) and its settings:

  [handlers.send_receipt]
  file = \"send_receipt.wasm\"
  namespace = \"billing\"
  memory_mib = 32
  timeout_ms = 10000
  max_attempts = 5
  kv_quota_mib = 16

Unset settings take each worker's flags (--memory-mib, --task-timeout-ms, ...).
The manifest is read whole first (a bad key stops everything); then the
handlers are deployed in order, and a refused module stops there, those
before it deployed.";

#[derive(Subcommand)]
enum HandlersCommand {
    /// A task's active version and its history, newest first.
    History {
        /// The task.
        task: String,
        #[command(flatten)]
        client: ClientArgs,
    },
}

#[derive(Args)]
#[command(group = clap::ArgGroup::new("what").required(true).args(["file", "manifest"]))]
struct DeployArgs {
    /// The component (`.wasm`, built for wasm32-wasip2).
    file: Option<std::path::PathBuf>,
    /// The task it handles. Default: the file's stem, `-` read as `_`.
    #[arg(long, conflicts_with = "manifest")]
    task: Option<String>,
    /// Deploy every handler of this TOML manifest instead (see below).
    #[arg(long, conflicts_with_all = ["file", "task"])]
    manifest: Option<std::path::PathBuf>,
    #[command(flatten)]
    settings: dtq_host::deploy::DeploySettings,
    /// Sign each deploy with this private key (`dtq keygen`), as a fleet
    /// with --trusted-keys requires: over the task, the module's SHA-256
    /// and the settings, sent as the `Dtq-Signature` header.
    #[arg(long)]
    sign_key: Option<std::path::PathBuf>,
    /// Wait up to this many seconds for every live worker to run the new
    /// version; 0 does not wait.
    #[arg(long, default_value_t = 10)]
    wait_s: u64,
    /// Deploy even when no live worker can honour the settings (the server
    /// refuses it otherwise, 409 NO_WORKER_CAN_RUN with each worker's
    /// reason): its tasks wait for a worker that can.
    #[arg(long)]
    force: bool,
    #[command(flatten)]
    client: ClientArgs,
}

#[derive(Subcommand)]
enum ScheduleCommand {
    /// Create or replace a schedule (needs `admin` on the queue and a grant
    /// covering the task, or the admin token): one task per
    /// tick across the fleet, fired by the workers consuming the queue.
    Set {
        /// The queue.
        queue: String,
        /// The schedule's name, unique in the queue.
        name: String,
        /// 5 fields (minute hour day-of-month month day-of-week), or 6 with
        /// seconds first; UTC. E.g. '*/5 * * * *'.
        #[arg(long)]
        cron: String,
        /// The task each tick submits (a deployed handler).
        #[arg(long)]
        task: String,
        /// The payload of each tick's task, JSON text.
        #[arg(long, default_value = "null")]
        payload: String,
        /// Attempts of each task.
        #[arg(long)]
        max_attempts: Option<u32>,
        /// Deadline of one attempt, ms.
        #[arg(long)]
        timeout_ms: Option<u64>,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// List a queue's schedules, with their next and last ticks.
    List {
        /// The queue.
        queue: String,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Delete a schedule (needs `admin` on the queue and a grant covering
    /// its task, or the admin token).
    Delete {
        /// The queue.
        queue: String,
        /// The schedule.
        name: String,
        #[command(flatten)]
        client: ClientArgs,
    },
}

#[derive(Subcommand)]
enum DlqCommand {
    /// List a queue's dead-lettered tasks.
    List {
        /// The queue.
        queue: String,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Requeue dead-lettered tasks (needs the admin token): the named ones,
    /// or --all. Attempt numbers go on rising, and each gets its original
    /// budget of attempts again.
    #[command(group = clap::ArgGroup::new("which").required(true).args(["ids", "all"]))]
    Requeue {
        /// The queue.
        queue: String,
        /// The task ids (one prints the task; several print
        /// `{"requeued", "not_dead_lettered", "key_taken"}`).
        ids: Vec<String>,
        /// Every task the DLQ holds now.
        #[arg(long)]
        all: bool,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Purge dead-lettered tasks for good (needs the admin token): each
    /// task's record and its idempotency record (the key can be submitted
    /// afresh, as a new task). Prints `{"purged"}`.
    #[command(group = clap::ArgGroup::new("which").required(true).args(["ids", "all", "older_than"]))]
    Purge {
        /// The queue.
        queue: String,
        /// The task ids.
        ids: Vec<String>,
        /// Every task the DLQ holds now.
        #[arg(long)]
        all: bool,
        /// Those dead-lettered longer ago than this: `500ms`, `45s`, `90m`,
        /// `12h`, `30d`.
        #[arg(long, value_name = "DURATION", value_parser = parse_duration_ms)]
        older_than: Option<u64>,
        #[command(flatten)]
        client: ClientArgs,
    },
}

/// `<number><unit>`, unit `ms`, `s`, `m`, `h` or `d`, as milliseconds.
fn parse_duration_ms(text: &str) -> Result<u64, String> {
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let scale: u64 = match unit {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => {
            return Err(format!(
                "{text:?}: give a number and a unit (ms, s, m, h, d), e.g. 30d"
            ));
        }
    };
    number
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(scale))
        .ok_or_else(|| format!("{text:?} is not a duration (e.g. 30d, 12h, 45s)"))
}

#[derive(Args, Clone)]
struct ClientArgs {
    /// Base URL of the dtq API.
    #[arg(long, env = "DTQ_API", default_value = "http://127.0.0.1:8080")]
    api: String,
    /// API token sent as `Authorization: Bearer`, when the API has tokens
    /// configured; the admin token is sent when this is not set.
    #[arg(long, env = "DTQ_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// Admin token, for admin routes.
    #[arg(long, env = "DTQ_ADMIN_TOKEN", hide_env_values = true)]
    admin_token: Option<String>,
}

#[derive(Args)]
struct SubmitArgs {
    /// The queue.
    queue: String,
    /// The task name (a deployed `<task>.wasm`).
    task: String,
    /// The payload: JSON text, `@FILE` to read it from a file, or `-` for stdin.
    payload: String,
    /// Idempotency key: one logical task per key while its record lives.
    #[arg(long, short = 'k')]
    idempotency_key: Option<String>,
    /// Attempts before dead-lettering (server default if unset).
    #[arg(long)]
    max_attempts: Option<u32>,
    /// Deadline of one attempt, ms.
    #[arg(long)]
    timeout_ms: Option<u64>,
    /// Run no earlier than this many ms from now.
    #[arg(long)]
    delay_ms: Option<u64>,
    /// Expire if not started within this many ms.
    #[arg(long)]
    expires_in_ms: Option<u64>,
    /// Run no earlier than this time: RFC 3339 (`2026-12-03T14:00:00Z`) or
    /// ms since the Unix epoch. Not with --delay-ms.
    #[arg(long, conflicts_with = "delay_ms")]
    run_at: Option<String>,
    /// Wait for the task to finish and print its final record.
    #[arg(long)]
    wait: bool,
    /// With --wait: give up after this many seconds.
    #[arg(long, default_value_t = 60)]
    wait_timeout_s: u64,
    #[command(flatten)]
    client: ClientArgs,
}

/// A failure with the exit code it maps to.
struct Failure {
    code: u8,
    error: anyhow::Error,
}

impl<E: Into<anyhow::Error>> From<E> for Failure {
    fn from(e: E) -> Self {
        Failure {
            code: 1,
            error: e.into(),
        }
    }
}

fn fail(code: u8, error: impl Into<anyhow::Error>) -> Failure {
    Failure {
        code,
        error: error.into(),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::from(1);
        }
    };
    match runtime.block_on(dispatch(cli.command)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure { code, error }) => {
            eprintln!("error: {}", one_line(&error));
            ExitCode::from(code)
        }
    }
}

/// The error and its causes on one line, each said once: a cause whose
/// text its error already ends with is not repeated.
fn one_line(error: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in error.chain() {
        let text = cause.to_string();
        if line.ends_with(&text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
    }
    line
}

async fn dispatch(command: Command) -> Result<(), Failure> {
    use reqwest::Method;
    let (client, method, path) = match command {
        Command::Serve(config) => return serve(config, Roles::SERVE).await,
        Command::Worker(config) => return serve(config, Roles::WORKER).await,
        Command::Api(config) => return serve(config, Roles::API).await,
        Command::Submit(args) => return submit(args).await,
        Command::SubmitBatch {
            queue,
            file,
            client,
        } => return submit_batch(Api::new(client)?, &queue, &file).await,
        Command::Watch {
            queue,
            task,
            since,
            client,
        } => return watch(Api::new(client)?, &queue, task, since).await,
        Command::Tasks {
            queue,
            status,
            limit,
            cursor,
            client,
        } => {
            let query = query(&[
                ("status", status),
                ("limit", limit.map(|n| n.to_string())),
                ("cursor", cursor),
            ]);
            let path = format!("{}{query}", path(&["queues", &queue, "tasks"])?);
            (client, Method::GET, path)
        }
        Command::Deploy(args) => return deploy(args).await,
        Command::Keygen { name } => return keygen(&name),
        Command::Handlers {
            command: None,
            client,
        } => (client, Method::GET, path(&["handlers"])?),
        Command::Handlers {
            command: Some(HandlersCommand::History { task, client }),
            ..
        } => (client, Method::GET, path(&["handlers", &task])?),
        Command::Undeploy { task, client } => (client, Method::DELETE, path(&["handlers", &task])?),
        Command::Rollback { task, to, client } => {
            let api = Api::new(client)?;
            let body = to
                .map(|to| json!({ "to": to }))
                .unwrap_or_else(|| json!({}));
            let path = path(&["handlers", &task, "rollback"])?;
            return print_json(&api.request(Method::POST, &path, Some(body), None).await?);
        }
        Command::Status { queue, id, client } => (
            client,
            Method::GET,
            path(&["queues", &queue, "tasks", &id])?,
        ),
        Command::Cancel { queue, id, client } => (
            client,
            Method::POST,
            path(&["queues", &queue, "tasks", &id, "cancel"])?,
        ),
        Command::Partitions {
            queue,
            count,
            client,
        } => {
            let path = path(&["queues", &queue, "partitions"])?;
            let api = Api::new(client)?;
            let body = json!({ "count": count });
            return print_json(&api.request(Method::PUT, &path, Some(body), None).await?);
        }
        Command::Queues {
            queue: Some(queue),
            client,
        } => (client, Method::GET, path(&["queues", &queue])?),
        Command::Queues {
            queue: None,
            client,
        } => (client, Method::GET, path(&["queues"])?),
        Command::Dlq(DlqCommand::List { queue, client }) => {
            (client, Method::GET, path(&["queues", &queue, "dlq"])?)
        }
        Command::Schedule(ScheduleCommand::Set {
            queue,
            name,
            cron,
            task,
            payload,
            max_attempts,
            timeout_ms,
            client,
        }) => {
            let payload: Value = serde_json::from_str(&payload)
                .map_err(|e| fail(2, anyhow::anyhow!("--payload is not JSON: {e}")))?;
            let mut body = json!({"cron": cron, "task": task, "payload": payload});
            if let Some(n) = max_attempts {
                body["max_attempts"] = json!(n);
            }
            if let Some(ms) = timeout_ms {
                body["timeout_ms"] = json!(ms);
            }
            let path = path(&["queues", &queue, "schedules", &name])?;
            let api = Api::new(client)?;
            return print_json(&api.request(Method::PUT, &path, Some(body), None).await?);
        }
        Command::Schedule(ScheduleCommand::List { queue, client }) => {
            (client, Method::GET, path(&["queues", &queue, "schedules"])?)
        }
        Command::Schedule(ScheduleCommand::Delete {
            queue,
            name,
            client,
        }) => (
            client,
            Method::DELETE,
            path(&["queues", &queue, "schedules", &name])?,
        ),
        Command::Dlq(DlqCommand::Requeue {
            queue,
            ids,
            all,
            client,
        }) => match ids.as_slice() {
            [id] if !all => (
                client,
                Method::POST,
                path(&["queues", &queue, "dlq", id, "requeue"])?,
            ),
            _ => {
                let body = if all {
                    json!({"all": true})
                } else {
                    json!({ "ids": ids })
                };
                let path = path(&["queues", &queue, "dlq", "requeue"])?;
                let api = Api::new(client)?;
                return print_json(&api.request(Method::POST, &path, Some(body), None).await?);
            }
        },
        Command::Dlq(DlqCommand::Purge {
            queue,
            ids,
            all,
            older_than,
            client,
        }) => {
            let body = match older_than {
                Some(ms) => json!({ "older_than_ms": ms }),
                None if all => json!({"all": true}),
                None => json!({ "ids": ids }),
            };
            let path = path(&["queues", &queue, "dlq"])?;
            let api = Api::new(client)?;
            return print_json(&api.request(Method::DELETE, &path, Some(body), None).await?);
        }
    };
    let api = Api::new(client)?;
    print_json(&api.request(method, &path, None, None).await?)
}

/// `/v1/<segments joined by />`, each segment percent-encoded, so that a
/// queue name or task id holding `/`, `%`, `?`, `#` or a space stays one
/// segment and cannot change which route is asked. `.` and `..` cannot be
/// sent as a segment at all (URL parsing takes them, even encoded, as path
/// steps), so they are refused here: no queue or task is named so.
fn path(segments: &[&str]) -> Result<String, Failure> {
    let mut path = String::from("/v1");
    for segment in segments {
        if *segment == "." || *segment == ".." {
            return Err(fail(
                2,
                anyhow::anyhow!("{segment:?} is not a queue name or a task id"),
            ));
        }
        path.push('/');
        path.push_str(&encoded(segment));
    }
    Ok(path)
}

/// `text` percent-encoded: every byte but unreserved ones.
fn encoded(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for byte in text.bytes() {
        match byte {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                out.push(char::from(byte));
            }
            _ => out.push_str(&format!("%{byte:02X}")),
        }
    }
    out
}

/// `?name=value&...` of the pairs that have a value, encoded; empty if none.
fn query(pairs: &[(&str, Option<String>)]) -> String {
    let mut query = String::new();
    for (name, value) in pairs {
        if let Some(value) = value {
            query.push(if query.is_empty() { '?' } else { '&' });
            query.push_str(&format!("{name}={}", encoded(value)));
        }
    }
    query
}

/// Run the server's `roles` until SIGINT or SIGTERM.
async fn serve(config: Config, roles: Roles) -> Result<(), Failure> {
    server::init_tracing(&config.log_format);
    server::run(config, roles, signal_shutdown())
        .await
        .map_err(server_failure)
}

/// A server error with its exit code and its causes on one line.
fn server_failure(e: ServerError) -> Failure {
    fail(e.exit_code(), e)
}

/// Resolves on the first SIGINT or SIGTERM.
async fn signal_shutdown() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = ctrl_c => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = ctrl_c.await;
            }
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
    info!("signal received: shutting down");
}

async fn submit(args: SubmitArgs) -> Result<(), Failure> {
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
    let mut body = json!({"task": args.task, "payload": payload});
    let options = [
        ("max_attempts", args.max_attempts.map(u64::from)),
        ("timeout_ms", args.timeout_ms),
        ("delay_ms", args.delay_ms),
        ("expires_in_ms", args.expires_in_ms),
    ];
    for (name, value) in options {
        if let Some(v) = value {
            body[name] = json!(v);
        }
    }
    if let Some(at) = args.run_at {
        body["run_at"] = at.parse::<u64>().map_or_else(|_| json!(at), |ms| json!(ms));
    }
    let api = Api::new(args.client)?;
    let submitted = api
        .request(
            reqwest::Method::POST,
            &path(&["queues", &args.queue, "tasks"])?,
            Some(body),
            args.idempotency_key.as_deref(),
        )
        .await?;
    if !args.wait {
        return print_json(&submitted);
    }
    let id = submitted["task_id"]
        .as_str()
        .context("the response has no task_id")?
        .to_owned();
    let task_path = path(&["queues", &args.queue, "tasks", &id])?;
    let deadline = Instant::now() + Duration::from_secs(args.wait_timeout_s);
    if !is_final(submitted["status"].as_str().unwrap_or_default()) {
        follow_events(&api, &args.queue, &id, deadline).await;
    }
    // The record decides (and is what is printed); after the events, or
    // when they could not be followed, polling.
    loop {
        let mut task = api
            .request(reqwest::Method::GET, &task_path, None, None)
            .await?;
        // Whether the submission was a replay is the submit's answer, not
        // the task's.
        task["duplicate"] = submitted["duplicate"].clone();
        let status = task["status"].as_str().unwrap_or_default().to_owned();
        match status.as_str() {
            "SUCCEEDED" => return print_json(&task),
            "FAILED" | "DEAD_LETTERED" | "CANCELLED" | "EXPIRED" => {
                print_json(&task)?;
                return Err(fail(4, anyhow::anyhow!("task {id} ended {status}")));
            }
            _ if Instant::now() > deadline => {
                print_json(&task)?;
                return Err(fail(
                    5,
                    anyhow::anyhow!("task {id} still {status} after {}s", args.wait_timeout_s),
                ));
            }
            _ => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

/// `dtq submit-batch`: the lines of `file` (blank ones skipped) in
/// batches of [`MAX_BATCH_ITEMS`](dtq_host::ingest::MAX_BATCH_ITEMS); a
/// line that is not JSON stops it before anything is sent.
#[allow(clippy::print_stdout)]
async fn submit_batch(api: Api, queue: &str, file: &str) -> Result<(), Failure> {
    let text = match file {
        "-" => std::io::read_to_string(std::io::stdin()).context("reading the tasks from stdin")?,
        f => std::fs::read_to_string(f).with_context(|| format!("reading the tasks from {f}"))?,
    };
    let mut items = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if !line.trim().is_empty() {
            let item: Value = serde_json::from_str(line)
                .map_err(|e| fail(2, anyhow::anyhow!("line {}: not JSON: {e}", i + 1)))?;
            items.push((i + 1, item));
        }
    }
    if items.is_empty() {
        return Err(fail(2, anyhow::anyhow!("{file} has no tasks")));
    }
    let path = path(&["queues", queue, "tasks", "batch"])?;
    let (mut new, mut replays, mut refused) = (0, 0, 0);
    for chunk in items.chunks(dtq_host::ingest::MAX_BATCH_ITEMS) {
        let tasks: Vec<&Value> = chunk.iter().map(|(_, item)| item).collect();
        let body = json!({ "tasks": tasks });
        let answer = api
            .request(reqwest::Method::POST, &path, Some(body), None)
            .await?;
        let results = answer["results"]
            .as_array()
            .context("the response has no results")?;
        for ((line, _), result) in chunk.iter().zip(results) {
            match result["status"].as_u64() {
                Some(202) => new += 1,
                Some(200) => replays += 1,
                _ => refused += 1,
            }
            let status = &result["status"];
            println!(
                "{}",
                json!({"line": line, "status": status, "body": result["body"]})
            );
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

/// Whether `status` is one a task ends in.
fn is_final(status: &str) -> bool {
    matches!(
        status,
        "SUCCEEDED" | "FAILED" | "DEAD_LETTERED" | "CANCELLED" | "EXPIRED"
    )
}

/// How far before a task's creation `submit --wait` starts reading its
/// events (ms): the task id's time is the API's clock, the events' ids
/// Redis's.
const EVENTS_CLOCK_SLACK_MS: u64 = 2_000;

/// Wait until task `id` may have ended, following its events: until an
/// event of a final status, a gap in the stream, or `deadline`. Returns
/// early, saying nothing, whenever the events cannot be followed (the
/// route refused, the stream broke): the caller polls the record then,
/// which decides in every case.
///
/// The subscription starts a little before the task was created (its
/// UUIDv7 holds the time), so events already written are read too; once
/// it is in place, the record is read once, for a task that ended before
/// anything the stream still holds.
async fn follow_events(api: &Api, queue: &str, id: &str, deadline: Instant) {
    let created_ms = uuid::Uuid::parse_str(id.split('.').next().unwrap_or(id))
        .ok()
        .and_then(|u| u.get_timestamp())
        .map(|ts| {
            let (secs, nanos) = ts.to_unix();
            secs * 1_000 + u64::from(nanos) / 1_000_000
        });
    let since = created_ms.map(|ms| format!("{}-0", ms.saturating_sub(EVENTS_CLOCK_SLACK_MS)));
    let Ok(events_path) = path(&["queues", queue, "events"]) else {
        return;
    };
    let url = format!(
        "{}{events_path}{}",
        api.base,
        query(&[("task_id", Some(id.to_owned())), ("since", since)])
    );
    let left = || deadline.saturating_duration_since(Instant::now());
    let opened = tokio::time::timeout(left(), api.with_token(api.http.get(&url)).send()).await;
    let response = match opened {
        Ok(Ok(response)) if response.status().is_success() => response,
        _ => return,
    };
    let mut events = dtq_host::client::sse::SseReader::new(response);
    let Ok(task_path) = path(&["queues", queue, "tasks", id]) else {
        return;
    };
    let record = api
        .with_token(api.http.get(format!("{}{task_path}", api.base)))
        .send()
        .await;
    match record {
        Ok(r) if r.status().is_success() => {
            let task: Value = r.json().await.unwrap_or(Value::Null);
            if is_final(task["status"].as_str().unwrap_or_default()) {
                return;
            }
        }
        _ => return,
    }
    loop {
        match tokio::time::timeout(left(), events.next()).await {
            Ok(Ok(Some(event))) if is_final(&event.event) || event.event == "gap" => return,
            Ok(Ok(Some(_))) => {}
            // The deadline, the end of the stream, or a broken one.
            _ => return,
        }
    }
}

/// `dtq watch`: print `queue`'s events (of `task`, if given) as JSON lines
/// until SIGINT or SIGTERM. A stream that ends or breaks is opened again
/// after the last event printed, with backoff; the first connection's
/// failure is the command's.
async fn watch(
    api: Api,
    queue: &str,
    task: Option<String>,
    since: Option<String>,
) -> Result<(), Failure> {
    let url = format!(
        "{}{}{}",
        api.base,
        path(&["queues", queue, "events"])?,
        query(&[("task_id", task)])
    );
    let follow = async {
        let mut last = since;
        let mut connected = false;
        let mut failures = 0u32;
        loop {
            let mut req = api
                .http
                .get(&url)
                .header(reqwest::header::ACCEPT, "text/event-stream");
            if let Some(id) = &last {
                req = req.header("Last-Event-ID", id);
            }
            // The first connection's failure is the command's (its error
            // body printed, its exit code); once connected, an unreachable
            // or overloaded server is waited out on stderr, and stdout
            // keeps only event lines.
            let opened = if connected {
                reopen(&api, req, &url).await
            } else {
                api.open(req, &url).await.map(Some)
            };
            match opened {
                Ok(None) => {}
                Ok(Some(response)) => {
                    connected = true;
                    failures = 0;
                    let mut events = dtq_host::client::sse::SseReader::new(response);
                    loop {
                        match events.next().await {
                            Ok(Some(event)) => {
                                match print_event_line(&event) {
                                    Ok(()) => {}
                                    // `dtq watch | head`: the reader left.
                                    Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {
                                        return Ok(());
                                    }
                                    Err(e) => return Err(e.into()),
                                }
                                if event.id.is_some() {
                                    last.clone_from(&event.id);
                                }
                            }
                            Ok(None) => {
                                eprintln!("warning: the event stream ended; reconnecting");
                                break;
                            }
                            Err(e) => {
                                eprintln!("warning: {e}; reconnecting");
                                break;
                            }
                        }
                    }
                }
                Err(f) => return Err(f),
            }
            failures = failures.saturating_add(1);
            let pause = Duration::from_millis(100) * (1u32 << failures.min(6));
            tokio::time::sleep(pause.min(Duration::from_secs(5))).await;
        }
    };
    tokio::select! {
        result = follow => result,
        () = signal_shutdown_quietly() => Ok(()),
    }
}

/// `dtq watch`'s reconnection: the response, or `None` after a warning on
/// stderr when the server cannot be reached or answers 503 (to be tried
/// again); any other refusal fails the command (exit 1).
async fn reopen(
    api: &Api,
    req: reqwest::RequestBuilder,
    url: &str,
) -> Result<Option<reqwest::Response>, Failure> {
    match api.with_token(req).send().await {
        Ok(response) if response.status().is_success() => Ok(Some(response)),
        Ok(response) if response.status() == reqwest::StatusCode::SERVICE_UNAVAILABLE => {
            eprintln!("warning: {url} answered {}; retrying", response.status());
            Ok(None)
        }
        Ok(response) => {
            let status = response.status();
            let body: Value = response.json().await.unwrap_or(Value::Null);
            let err = &body["error"];
            Err(fail(
                1,
                anyhow::anyhow!(
                    "{} ({status}): {}",
                    err["code"].as_str().unwrap_or("HTTP error"),
                    err["message"].as_str().unwrap_or(url)
                ),
            ))
        }
        Err(e) => {
            eprintln!("warning: cannot reach {url}: {e}; retrying");
            Ok(None)
        }
    }
}

/// Resolves on the first SIGINT or SIGTERM, without a log line.
async fn signal_shutdown_quietly() {
    #[cfg(unix)]
    if let Ok(mut term) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
    {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        return;
    }
    let _ = tokio::signal::ctrl_c().await;
}

/// One event as a JSON line on stdout, flushed: its `id` (null for `gap`)
/// and `event`, and the fields of its data (or the data as `data`, when it
/// is not an object).
fn print_event_line(event: &dtq_host::client::sse::SseEvent) -> std::io::Result<()> {
    use std::io::Write as _;
    let mut line = serde_json::Map::new();
    line.insert("id".into(), json!(event.id));
    line.insert("event".into(), json!(event.event));
    match serde_json::from_str::<Value>(&event.data) {
        Ok(Value::Object(fields)) => line.extend(fields),
        _ => {
            line.insert("data".into(), json!(event.data));
        }
    }
    let mut out = std::io::stdout().lock();
    writeln!(out, "{}", Value::Object(line))?;
    out.flush()
}

/// A client of one dtq API: one HTTP client (one connection pool) for all
/// of a command's requests, and the token they carry.
struct Api {
    http: reqwest::Client,
    base: String,
    token: Option<String>,
}

impl Api {
    fn new(args: ClientArgs) -> Result<Api, Failure> {
        let http = reqwest::Client::builder()
            .build()
            .context("cannot set up the HTTP client")?;
        Ok(Api {
            http,
            base: args.api.trim_end_matches('/').to_owned(),
            token: args.token.or(args.admin_token),
        })
    }

    /// One API request to `path` (already encoded, see [`path`]). A
    /// response with an error body becomes a failure that shows its code
    /// and message; the body itself is printed to stdout too, so scripts
    /// can read `details` (e.g. the in-flight task of a 409).
    async fn request(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
        idempotency_key: Option<&str>,
    ) -> Result<Value, Failure> {
        let url = format!("{}{path}", self.base);
        let mut req = self.http.request(method, &url);
        if let Some(body) = body {
            req = req.json(&body);
        }
        if let Some(key) = idempotency_key {
            req = req.header("Idempotency-Key", key);
        }
        self.send(req, &url).await
    }

    /// `PUT` module `wasm` with `settings` as the query.
    async fn put_module(
        &self,
        path: &str,
        wasm: Vec<u8>,
        settings: &dtq_host::deploy::DeploySettings,
        force: bool,
        signature: Option<&str>,
    ) -> Result<Value, Failure> {
        let url = format!("{}{path}", self.base);
        let mut req = self.http.put(&url).query(settings);
        if force {
            req = req.query(&[("force", "true")]);
        }
        let mut req = req
            .header(reqwest::header::CONTENT_TYPE, "application/wasm")
            .body(wasm);
        if let Some(signature) = signature {
            req = req.header(dtq_host::deploy::SIGNATURE_HEADER, signature);
        }
        self.send(req, &url).await
    }

    async fn send(&self, req: reqwest::RequestBuilder, url: &str) -> Result<Value, Failure> {
        let resp = self.open(req, url).await?;
        Ok(resp.json().await.unwrap_or(Value::Null))
    }

    /// `req` with the command's token, if it has one.
    fn with_token(&self, req: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match &self.token {
            Some(token) => req.bearer_auth(token),
            None => req,
        }
    }

    /// Send `req` and return the response, its body unread, if it is a
    /// success; a failure as [`Api::request`] makes it otherwise.
    async fn open(
        &self,
        req: reqwest::RequestBuilder,
        url: &str,
    ) -> Result<reqwest::Response, Failure> {
        let resp = self
            .with_token(req)
            .send()
            .await
            .map_err(|e| fail(3, anyhow::anyhow!("cannot reach {url}: {e}")))?;
        let status = resp.status();
        if status.is_success() {
            return Ok(resp);
        }
        let value: Value = resp.json().await.unwrap_or(Value::Null);
        print_json(&value)?;
        let err = &value["error"];
        match (err["code"].as_str(), err["message"].as_str()) {
            (Some(code), Some(message)) => {
                let exit = if status == reqwest::StatusCode::SERVICE_UNAVAILABLE {
                    3
                } else {
                    1
                };
                Err(fail(exit, anyhow::anyhow!("{code} ({status}): {message}")))
            }
            _ => Err(fail(1, anyhow::anyhow!("HTTP {status} from {url}"))),
        }
    }
}

/// One handler to deploy: its task, module file and settings.
struct Deployment {
    task: String,
    file: std::path::PathBuf,
    settings: dtq_host::deploy::DeploySettings,
}

/// The default task name of a module file: its stem, `-` read as `_`.
fn task_of(file: &std::path::Path) -> Result<String, Failure> {
    file.file_stem()
        .and_then(|s| s.to_str())
        .map(|s| s.replace('-', "_"))
        .ok_or_else(|| {
            fail(
                2,
                anyhow::anyhow!("cannot name a task after {}", file.display()),
            )
        })
}

/// The handlers of a manifest: `[handlers.<task>]` tables, each with a
/// `file` (relative to the manifest) and settings.
fn read_manifest(path: &std::path::Path) -> Result<Vec<Deployment>, Failure> {
    let bad = |e: String| fail(2, anyhow::anyhow!("{}: {e}", path.display()));
    let text = std::fs::read_to_string(path)
        .map_err(|e| fail(2, anyhow::anyhow!("cannot read {}: {e}", path.display())))?;
    let mut doc: toml::Table = text
        .parse()
        .map_err(|e: toml::de::Error| bad(e.to_string()))?;
    let Some(toml::Value::Table(handlers)) = doc.remove("handlers") else {
        return Err(bad("no [handlers.<task>] table".into()));
    };
    if let Some(other) = doc.keys().next() {
        return Err(bad(format!(
            "unknown key {other:?} (only [handlers.<task>] tables)"
        )));
    }
    let base = path.parent().unwrap_or(std::path::Path::new("."));
    let mut out = Vec::new();
    for (task, table) in handlers {
        let toml::Value::Table(mut table) = table else {
            return Err(bad(format!("handlers.{task} is not a table")));
        };
        let Some(toml::Value::String(file)) = table.remove("file") else {
            return Err(bad(format!("handlers.{task} has no `file`")));
        };
        let settings = table
            .try_into()
            .map_err(|e: toml::de::Error| bad(format!("handlers.{task}: {e}")))?;
        out.push(Deployment {
            file: base.join(file),
            task,
            settings,
        });
    }
    Ok(out)
}

async fn deploy(args: DeployArgs) -> Result<(), Failure> {
    let deployments = match (&args.manifest, args.file) {
        (Some(manifest), _) => read_manifest(manifest)?,
        (None, Some(file)) => vec![Deployment {
            task: match args.task {
                Some(task) => task,
                None => task_of(&file)?,
            },
            file,
            settings: args.settings,
        }],
        (None, None) => return Err(fail(2, anyhow::anyhow!("name a module or --manifest"))),
    };
    let sign_key = match &args.sign_key {
        Some(path) => Some(SigningKeyFile::load(path).map_err(|e| fail(2, e))?),
        None => None,
    };
    let api = Api::new(args.client)?;
    let mut results = Vec::new();
    for d in &deployments {
        let wasm = std::fs::read(&d.file)
            .map_err(|e| fail(2, anyhow::anyhow!("cannot read {}: {e}", d.file.display())))?;
        let path = path(&["handlers", &d.task])?;
        let signature = sign_key
            .as_ref()
            .map(|k| k.sign(&d.task, &wasm, &d.settings));
        let deployed = api
            .put_module(&path, wasm, &d.settings, args.force, signature.as_deref())
            .await?;
        if let Some(warning) = deployed["warning"].as_str() {
            eprintln!("warning: {}: {warning}", d.task);
        }
        results.push(deployed);
    }
    let stored = Instant::now();
    let wait = Duration::from_secs(args.wait_s);
    for result in &mut results {
        result["rollout"] = rollout(&api, result, stored, wait).await?;
    }
    match <[Value; 1]>::try_from(results) {
        Ok([one]) if args.manifest.is_none() => print_json(&one),
        Ok(one) => print_json(&json!(one)),
        Err(all) => print_json(&json!(all)),
    }
}

/// `dtq keygen NAME`: write the pair, print where and the public line.
fn keygen(path: &std::path::Path) -> Result<(), Failure> {
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .filter(|n| !n.is_empty() && !n.contains(char::is_whitespace))
        .ok_or_else(|| {
            fail(
                2,
                anyhow::anyhow!("name the key file (no spaces in its name)"),
            )
        })?;
    let key = SigningKeyFile::generate(name);
    let public = key.write(path).map_err(|e| fail(2, e))?;
    print_json(&json!({
        "private": path.display().to_string(),
        "public": public.display().to_string(),
        "key": key.public_line(),
    }))
}

/// Wait (up to `wait` from `stored`) until every live worker runs the
/// deployed version of `deployed` (its module with its settings: the
/// fingerprint, as a settings-only change keeps the digest), or failed to
/// load it; report how many did, which failed and why, and when.
async fn rollout(
    api: &Api,
    deployed: &Value,
    stored: Instant,
    wait: Duration,
) -> Result<Value, Failure> {
    let (task, digest) = (&deployed["task"], &deployed["digest"]);
    let fingerprint = &deployed["fingerprint"];
    loop {
        let fleet = api
            .request(reqwest::Method::GET, &path(&["handlers"])?, None, None)
            .await?;
        let workers = fleet["workers"].as_array().cloned().unwrap_or_default();
        let task = task.as_str().unwrap_or_default();
        // A worker too old to report fingerprints (or capacity) is judged
        // by the digest alone.
        let runs = |w: &Value| match w["fingerprints"][task].as_str() {
            Some(f) => *fingerprint == f,
            None if w["capacity"].is_object() => false,
            None => w["loaded"][task] == *digest,
        };
        let running = workers.iter().filter(|w| runs(w)).count();
        let failed: serde_json::Map<String, Value> = workers
            .iter()
            .filter(|w| !runs(w) && w["failed"][task].is_string())
            .map(|w| {
                (
                    w["id"].as_str().unwrap_or("?").to_owned(),
                    w["failed"][task].clone(),
                )
            })
            .collect();
        let settled = running + failed.len() == workers.len();
        if settled || stored.elapsed() >= wait {
            if !failed.is_empty() {
                eprintln!(
                    "warning: {} worker(s) cannot run {task}: see rollout.failed",
                    failed.len()
                );
            } else if !settled {
                eprintln!(
                    "warning: {running} of {} workers run {task}'s new version after {}s",
                    workers.len(),
                    wait.as_secs()
                );
            }
            return Ok(json!({
                "workers": workers.len(),
                "running": running,
                "failed": failed,
                "waited_ms": stored.elapsed().as_millis() as u64,
            }));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[allow(clippy::print_stdout)]
fn print_json(value: &Value) -> Result<(), Failure> {
    println!("{}", serde_json::to_string_pretty(value)?);
    Ok(())
}
