//! The commands on a queue and its tasks: `status`, `tasks`, `cancel`,
//! `queues`, `partitions`, `dlq`, `schedule`. Each prints the answer.

use dtq_host::client::{Client, DlqSelection, ScheduleRequest};
use serde_json::Value;

use super::args::{DlqCommand, ScheduleCommand};
use super::print::print_json;
use super::{Failure, client, fail};

/// `dtq status`.
pub(crate) async fn status(api: Client, queue: &str, id: &str) -> Result<(), Failure> {
    print_json(&api.task(queue, id).await?)
}

/// `dtq cancel`.
pub(crate) async fn cancel(api: Client, queue: &str, id: &str) -> Result<(), Failure> {
    print_json(&api.cancel(queue, id).await?)
}

/// `dtq tasks`.
pub(crate) async fn tasks(
    api: Client,
    queue: &str,
    status: Option<&str>,
    limit: Option<u32>,
    cursor: Option<&str>,
) -> Result<(), Failure> {
    print_json(&api.tasks(queue, status, limit, cursor).await?)
}

/// `dtq queues [QUEUE]`.
pub(crate) async fn queues(api: Client, queue: Option<&str>) -> Result<(), Failure> {
    match queue {
        Some(queue) => print_json(&api.queue(queue).await?),
        None => print_json(&api.queues().await?),
    }
}

/// `dtq partitions`.
pub(crate) async fn partitions(api: Client, queue: &str, count: u32) -> Result<(), Failure> {
    print_json(&api.raise_partitions(queue, count).await?)
}

/// `dtq dlq ...`.
pub(crate) async fn dlq(command: DlqCommand) -> Result<(), Failure> {
    match command {
        DlqCommand::List { queue, client: c } => print_json(&client(c)?.dlq(&queue).await?),
        DlqCommand::Requeue {
            queue,
            ids,
            all,
            client: c,
        } => {
            let api = client(c)?;
            match ids.as_slice() {
                [id] if !all => print_json(&api.requeue(&queue, id).await?),
                _ => {
                    let which = if all {
                        DlqSelection::All
                    } else {
                        DlqSelection::Ids(ids)
                    };
                    print_json(&api.requeue_many(&queue, &which).await?)
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
            print_json(&client(c)?.purge(&queue, &which).await?)
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
            print_json(&client(c)?.set_schedule(&queue, &name, &schedule).await?)
        }
        ScheduleCommand::List { queue, client: c } => {
            print_json(&client(c)?.schedules(&queue).await?)
        }
        ScheduleCommand::Delete {
            queue,
            name,
            client: c,
        } => print_json(&client(c)?.delete_schedule(&queue, &name).await?),
    }
}
