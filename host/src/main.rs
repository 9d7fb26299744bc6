//! The `dtq` command: the server (`serve`, `worker`, `api`) and a client for
//! its HTTP API (`submit`, `status`, `cancel`, `queues`, `dlq`).

use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use dtq_host::api::{self, ApiState, HandlerCheck};
use dtq_host::sandbox::Sandbox;
use dtq_host::store::Store;
use dtq_host::{Config, worker};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;
use tracing::info;

/// mimalloc: a worker allocates and frees a little per task on several
/// threads at once, where glibc's allocator spends noticeably more.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

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
    /// Show a task: status, attempts, result, error, log, timestamps.
    Status {
        /// The task's queue.
        queue: String,
        /// The task id.
        id: String,
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
    /// List or requeue dead-lettered tasks.
    #[command(subcommand)]
    Dlq(DlqCommand),
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
    /// Requeue a dead-lettered task (needs the admin token).
    Requeue {
        /// The queue.
        queue: String,
        /// The task id.
        id: String,
        #[command(flatten)]
        client: ClientArgs,
    },
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
            eprintln!("error: {error:#}");
            ExitCode::from(code)
        }
    }
}

async fn dispatch(command: Command) -> Result<(), Failure> {
    use reqwest::Method;
    let (client, method, path) = match command {
        Command::Serve(config) => return server(config, true, true).await,
        Command::Worker(config) => return server(config, false, true).await,
        Command::Api(config) => return server(config, true, false).await,
        Command::Submit(args) => return submit(args).await,
        Command::Status { queue, id, client } => (
            client,
            Method::GET,
            format!("/v1/queues/{queue}/tasks/{id}"),
        ),
        Command::Cancel { queue, id, client } => (
            client,
            Method::POST,
            format!("/v1/queues/{queue}/tasks/{id}/cancel"),
        ),
        Command::Queues {
            queue: Some(queue),
            client,
        } => (client, Method::GET, format!("/v1/queues/{queue}")),
        Command::Queues {
            queue: None,
            client,
        } => (client, Method::GET, "/v1/queues".to_owned()),
        Command::Dlq(DlqCommand::List { queue, client }) => {
            (client, Method::GET, format!("/v1/queues/{queue}/dlq"))
        }
        Command::Dlq(DlqCommand::Requeue { queue, id, client }) => (
            client,
            Method::POST,
            format!("/v1/queues/{queue}/dlq/{id}/requeue"),
        ),
    };
    print_json(&request(&client, method, &path, None).await?)
}

fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("DTQ_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Colour only for a person at a terminal, never into a file or a pipe.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .try_init();
}

/// Run the API, the worker, or both, until SIGINT or SIGTERM.
async fn server(config: Config, with_api: bool, with_worker: bool) -> Result<(), Failure> {
    init_tracing();
    config.validate().map_err(|e| fail(2, anyhow::anyhow!(e)))?;
    let store = Store::connect(&config.redis_url, config.store_settings())
        .await
        .map_err(|e| {
            fail(
                3,
                anyhow::anyhow!("cannot reach Redis at {}: {e}", config.redis_url),
            )
        })?;

    let sandbox = if with_worker {
        Some(load_sandbox(&config, &store)?)
    } else {
        None
    };
    let has_handler: HandlerCheck = match &sandbox {
        Some(sandbox) => {
            let sandbox = sandbox.clone();
            Arc::new(move |task: &str| sandbox.has_handler(task))
        }
        // An API-only process checks the deployed files, so a module copied
        // into the directory is accepted without a restart.
        None => {
            let dir = config.handlers.clone();
            Arc::new(move |task: &str| dir.join(format!("{task}.wasm")).is_file())
        }
    };

    let stop = CancellationToken::new();
    tokio::spawn(signal_shutdown(stop.clone()));

    let api_task = if with_api {
        let api_settings = config
            .api_settings()
            .map_err(|e| fail(2, anyhow::anyhow!(e)))?;
        let listener = tokio::net::TcpListener::bind(config.listen)
            .await
            .with_context(|| format!("cannot listen on {}", config.listen))?;
        let state = ApiState {
            store: store.clone(),
            ingest: config.ingest_settings(),
            admin_token: config.admin_token.clone(),
            has_handler,
        };
        Some(tokio::spawn(api::serve_with(
            listener,
            state,
            api_settings,
            stop.clone().cancelled_owned(),
        )))
    } else {
        None
    };
    if let Some(sandbox) = sandbox {
        worker::run(store, sandbox, config, stop.clone().cancelled_owned()).await?;
    } else {
        stop.cancelled().await;
    }
    if let Some(api_task) = api_task {
        api_task.await.context("API task")?.context("API server")?;
    }
    Ok(())
}

fn load_sandbox(config: &Config, store: &Store) -> Result<Sandbox, Failure> {
    let sandbox = Sandbox::new(config.sandbox_config(), store.connection())
        .context("cannot set up the sandbox")?;
    if !config.handlers.is_dir() {
        return Err(fail(
            2,
            anyhow::anyhow!(
                "handlers directory {} does not exist (set --handlers or DTQ_HANDLERS)",
                config.handlers.display()
            ),
        ));
    }
    let started = Instant::now();
    let report = sandbox.load_dir(Path::new(&config.handlers)).map_err(|e| {
        fail(
            2,
            anyhow::anyhow!("cannot read the handlers directory: {e}"),
        )
    })?;
    // A bad module is one line in the log; the good ones run.
    for (file, error) in &report.failed {
        let error = error.to_string();
        let error = error.split_whitespace().collect::<Vec<_>>().join(" ");
        tracing::error!("handler skipped: {}: {error}", file.display());
    }
    if report.loaded.is_empty() {
        tracing::warn!(dir = %config.handlers.display(), "no <task>.wasm handlers loaded");
    }
    info!(handlers = ?report.loaded, skipped = report.failed.len(),
        elapsed_ms = started.elapsed().as_millis() as u64, "handlers loaded");
    Ok(sandbox)
}

/// Cancel `stop` on the first SIGINT or SIGTERM.
async fn signal_shutdown(stop: CancellationToken) {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => {
                    let _ = ctrl_c.await;
                    stop.cancel();
                    return;
                }
            };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
    info!("signal received: shutting down");
    stop.cancel();
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
    let client = &args.client;
    let path = format!("/v1/queues/{}/tasks", args.queue);
    let submitted = request_with(
        client,
        reqwest::Method::POST,
        &path,
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
    let deadline = Instant::now() + Duration::from_secs(args.wait_timeout_s);
    loop {
        let mut task = request(
            client,
            reqwest::Method::GET,
            &format!("/v1/queues/{}/tasks/{id}", args.queue),
            None,
        )
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

async fn request(
    client: &ClientArgs,
    method: reqwest::Method,
    path: &str,
    body: Option<Value>,
) -> Result<Value, Failure> {
    request_with(client, method, path, body, None).await
}

/// One API request. A response with an error body becomes a failure that
/// shows its code and message; the body itself is printed to stdout too, so
/// scripts can read `details` (e.g. the in-flight task of a 409).
async fn request_with(
    client: &ClientArgs,
    method: reqwest::Method,
    path: &str,
    body: Option<Value>,
    idempotency_key: Option<&str>,
) -> Result<Value, Failure> {
    let url = format!("{}{path}", client.api.trim_end_matches('/'));
    let mut req = reqwest::Client::new().request(method, &url);
    if let Some(body) = body {
        req = req.json(&body);
    }
    if let Some(key) = idempotency_key {
        req = req.header("Idempotency-Key", key);
    }
    if let Some(token) = client.token.as_ref().or(client.admin_token.as_ref()) {
        req = req.bearer_auth(token);
    }
    let resp = req
        .send()
        .await
        .map_err(|e| fail(3, anyhow::anyhow!("cannot reach {url}: {e}")))?;
    let status = resp.status();
    let value: Value = resp.json().await.unwrap_or(Value::Null);
    if status.is_success() {
        return Ok(value);
    }
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

#[allow(clippy::print_stdout)]
fn print_json(value: &Value) -> Result<(), Failure> {
    println!("{}", serde_json::to_string_pretty(value)?);
    Ok(())
}
