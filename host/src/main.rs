//! The `dtq` command: the server (`serve`, `worker`, `api`) and a client for
//! its HTTP API (`submit`, `submit-batch`, `status`, `tasks`, `watch`, `cancel`, `queues`,
//! `dlq`, `deploy`, `handlers`, `rollback`, `undeploy`).
//!
//! This file is the wiring: parse the command line, run the command, map
//! its failure to an exit code. The client commands are in [`cli`], over
//! [`dtq_host::client`]; the server is [`dtq_host::server`].

mod cli;

use std::process::ExitCode;

use clap::Parser;
use dtq_host::Config;
use dtq_host::client::TaskQuery;
use dtq_host::server::{self, Roles, ServerError};
use tracing::info;

use cli::args::{Cli, Command, HandlersCommand};
use cli::print::{self, Format, print_json};
use cli::{Failure, client, deploy, fail, queues, submit, watch};

/// mimalloc: a worker allocates and frees a little per task on several
/// threads at once, where glibc's allocator spends noticeably more.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

// Lazy arena commit and no transparent huge pages (`dtq_host::allocator`).
dtq_host::mimalloc_defaults!();

fn main() -> ExitCode {
    let cli = Cli::parse();
    print::init(cli.json);
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::from(1);
        }
    };
    match runtime.block_on(dispatch(cli.command)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure {
            code,
            error,
            answer,
        }) => {
            print_answer(answer.as_ref());
            eprintln!("error: {}", one_line(&error));
            ExitCode::from(code)
        }
    }
}

/// The server's answer to a refused request: on stdout as JSON for a
/// script; for a person, its details (the in-flight task of a 409, ...)
/// on stderr before the error, which says the rest.
fn print_answer(answer: Option<&serde_json::Value>) {
    let Some(answer) = answer else { return };
    match print::format() {
        Format::Json => {
            let _ = print_json(answer);
        }
        Format::Table => {
            let details = &answer["error"]["details"];
            if details.as_object().is_some_and(|d| !d.is_empty()) {
                eprintln!("details: {details}");
            }
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
    match command {
        Command::Serve(config) => serve(config, Roles::SERVE).await,
        Command::Worker(config) => serve(config, Roles::WORKER).await,
        Command::Api(config) => serve(config, Roles::API).await,
        Command::Submit(args) => submit::submit(args).await,
        Command::SubmitBatch {
            queue,
            file,
            client: c,
        } => submit::submit_batch(client(c)?, &queue, &file).await,
        Command::Watch {
            queue,
            task,
            since,
            client: c,
        } => watch::watch(client(c)?, &queue, task, since).await,
        Command::Status {
            queue,
            id,
            client: c,
        } => queues::status(client(c)?, &queue, &id).await,
        Command::Cancel {
            queue,
            id,
            client: c,
        } => queues::cancel(client(c)?, &queue, &id).await,
        Command::Tasks {
            queue,
            status,
            task,
            limit,
            cursor,
            client: c,
        } => {
            let query = TaskQuery {
                status: status.as_deref(),
                task: task.as_deref(),
                limit,
                cursor: cursor.as_deref(),
            };
            queues::tasks(client(c)?, &queue, &query).await
        }
        Command::Queues { queue, client: c } => queues::queues(client(c)?, queue.as_deref()).await,
        Command::Partitions {
            queue,
            count,
            client: c,
        } => queues::partitions(client(c)?, &queue, count).await,
        Command::Dlq(command) => queues::dlq(command).await,
        Command::Schedule(command) => queues::schedule(command).await,
        Command::Deploy(args) => deploy::deploy(args).await,
        Command::Keygen { name } => deploy::keygen(&name),
        Command::Handlers {
            command: None,
            client: c,
        } => deploy::handlers(client(c)?, None).await,
        Command::Handlers {
            command: Some(HandlersCommand::History { task, client: c }),
            ..
        } => deploy::handlers(client(c)?, Some(&task)).await,
        Command::Rollback {
            task,
            to,
            client: c,
        } => deploy::rollback(client(c)?, &task, to).await,
        Command::Undeploy { task, client: c } => deploy::undeploy(client(c)?, &task).await,
    }
}

/// Run the server's `roles` until SIGINT or SIGTERM; a server error with
/// its exit code and its causes on one line.
async fn serve(config: Config, roles: Roles) -> Result<(), Failure> {
    server::init_tracing_with(&config);
    let shutdown = async {
        cli::shutdown_signal().await;
        info!("signal received: shutting down");
    };
    server::run(config, roles, shutdown)
        .await
        .map_err(|e: ServerError| fail(e.exit_code(), e))
}
