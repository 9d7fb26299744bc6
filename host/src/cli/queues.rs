//! The commands on a queue and its tasks: `status`, `tasks`, `cancel`,
//! `queues`, `partitions`, `dlq`, `schedule`. Each prints the answer.

use dtq_host::client::{Client, DlqSelection, ScheduleRequest, TaskQuery};
use serde_json::Value;

use super::args::{DlqCommand, ScheduleCommand};
use super::print::show;
use super::table::View;
use super::{Failure, client, fail};

/// `dtq status`.
pub(crate) async fn status(api: Client, queue: &str, id: &str) -> Result<(), Failure> {
    show(View::Task, &api.task(queue, id).await?)
}

/// `dtq cancel`.
pub(crate) async fn cancel(api: Client, queue: &str, id: &str) -> Result<(), Failure> {
    show(View::Task, &api.cancel(queue, id).await?)
}

/// `dtq tasks`.
pub(crate) async fn tasks(api: Client, queue: &str, query: &TaskQuery<'_>) -> Result<(), Failure> {
    show(View::TaskPage, &api.tasks(queue, query).await?)
}

/// `dtq queues [QUEUE]`.
pub(crate) async fn queues(api: Client, queue: Option<&str>) -> Result<(), Failure> {
    match queue {
        Some(queue) => show(View::Queues, &api.queue(queue).await?),
        None => show(View::Queues, &api.queues().await?),
    }
}

/// `dtq partitions`.
pub(crate) async fn partitions(api: Client, queue: &str, count: u32) -> Result<(), Failure> {
    show(View::Record, &api.raise_partitions(queue, count).await?)
}

/// `dtq dlq ...`.
pub(crate) async fn dlq(command: DlqCommand) -> Result<(), Failure> {
    match command {
        DlqCommand::List { queue, client: c } => {
            show(View::DeadLetters, &client(c)?.dlq(&queue).await?)
        }
        DlqCommand::Requeue {
            queue,
            ids,
            all,
            client: c,
        } => {
            let api = client(c)?;
            match ids.as_slice() {
                [id] if !all => show(View::Task, &api.requeue(&queue, id).await?),
                _ => {
                    let which = if all {
                        DlqSelection::All
                    } else {
                        DlqSelection::Ids(ids)
                    };
                    show(View::Record, &api.requeue_many(&queue, &which).await?)
                }
            }
        }
        DlqCommand::Purge {
            queue,
            ids,
            all,
            older_than,
            client: c,
        } => {
            let which = match older_than {
                Some(ms) => DlqSelection::OlderThanMs(ms),
                None if all => DlqSelection::All,
                None => DlqSelection::Ids(ids),
            };
            show(View::Record, &client(c)?.purge(&queue, &which).await?)
        }
    }
}

/// `dtq schedule ...`.
pub(crate) async fn schedule(command: ScheduleCommand) -> Result<(), Failure> {
    match command {
        ScheduleCommand::Set {
            queue,
            name,
            cron,
            task,
            payload,
            max_attempts,
            timeout_ms,
            client: c,
        } => {
            let payload: Value = serde_json::from_str(&payload)
                .map_err(|e| fail(2, anyhow::anyhow!("--payload is not JSON: {e}")))?;
            let schedule = ScheduleRequest {
                cron,
                task,
                payload,
                max_attempts,
                timeout_ms,
            };
            show(
                View::Record,
                &client(c)?.set_schedule(&queue, &name, &schedule).await?,
            )
        }
        ScheduleCommand::List { queue, client: c } => {
            show(View::Schedules, &client(c)?.schedules(&queue).await?)
        }
        ScheduleCommand::Delete {
            queue,
            name,
            client: c,
        } => show(
            View::Record,
            &client(c)?.delete_schedule(&queue, &name).await?,
        ),
    }
}
