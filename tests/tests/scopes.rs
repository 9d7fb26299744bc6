//! Token scopes against the fleet's objects (issue 31): a token with
//! `admin` on one queue owns that queue's things and nothing of the fleet.
//! Each fleet route (deploy, rollback, undeploy, partitions, schedule put
//! and delete) refuses a queue-scoped admin with 403 and changes nothing,
//! and serves a grant that covers it; a deploy grant deploys only within
//! its tasks, namespaces, hosts and quota.
//!
//! Each test runs the real API (`Dtq`) against its own `redis-server`, with
//! the tokens of [`TOKENS`], and deploys the real `echo` guest.

use anyhow::{Context, Result, ensure};
use dtq_tests::{Dtq, assert_error, guests};
use reqwest::Method;
use serde_json::{Value, json};

/// The fleet's operator (`--admin-token`: admin on every queue).
const OPERATOR: &str = "scopes-operator-3c1f9a7e5b2d8046";
/// `admin` (and submit, read) on queue `emails` only.
const QUEUE_ADMIN: &str = "scopes-queue-admin-8e4b2c6a0f1d3957";
/// `admin` on `emails`, granted the `echo` task for schedules.
const MAIL_ADMIN: &str = "scopes-mail-admin-5a9d1e3c7b0f2468";
/// `read` on every queue (the registry's routes need it).
const READER: &str = "scopes-reader-7c2e9b4d1a6f3058";
/// A deploy grant: tasks `greeter` and `mail-*`, namespace `mail`, hosts
/// under `mailer.example`, a quota of at most 4 MiB.
const DEPLOYER: &str = "scopes-deployer-1b7e3a9c5d0f4826";

fn tokens() -> String {
    [
        format!("{QUEUE_ADMIN} admin,submit,read emails"),
        format!("{READER} read"),
        format!("{MAIL_ADMIN} admin emails tasks=echo"),
        format!(
            "{DEPLOYER} deploy tasks=greeter,mail-* namespaces=mail \
             hosts=https://*.mailer.example kv_quota_mib=4"
        ),
    ]
    .join(";")
}

async fn start() -> Result<Dtq> {
    let tokens = tokens();
    Dtq::start(false, &["--tokens", &tokens, "--admin-token", OPERATOR]).await
}

async fn call(
    dtq: &Dtq,
    method: Method,
    path: &str,
    body: Option<Value>,
    token: &str,
) -> Result<(u16, Value)> {
    let auth = format!("Bearer {token}");
    dtq.call(method, path, body, &[("Authorization", &auth)])
        .await
}

async fn deploy(
    dtq: &Dtq,
    task: &str,
    settings: &[(&str, &str)],
    token: &str,
) -> Result<(u16, Value)> {
    let echo = std::fs::read(guests::ECHO).context("reading the echo guest")?;
    dtq.deploy(task, echo, settings, token).await
}

/// A 403 `FORBIDDEN` whose details name `scope` (and `field: value` when
/// given).
fn assert_forbidden(response: &(u16, Value), scope: &str, field: Option<(&str, Value)>) {
    assert_error(response, 403, "FORBIDDEN");
    let details = &response.1["error"]["details"];
    assert_eq!(details["scope"], scope, "{}", response.1);
    if let Some((name, value)) = field {
        assert_eq!(details[name], value, "{}", response.1);
    }
    let message = response.1["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains(scope),
        "the message names the scope: {message}"
    );
}

/// `GET /v1/handlers/{task}`: what the registry holds for it.
async fn handler(dtq: &Dtq, task: &str) -> Result<Value> {
    let (status, body) = call(
        dtq,
        Method::GET,
        &format!("/v1/handlers/{task}"),
        None,
        READER,
    )
    .await?;
    ensure!(status == 200, "history of {task}: {status} {body}");
    Ok(body)
}

#[tokio::test(flavor = "multi_thread")]
async fn deploy_refuses_a_queue_admin_and_serves_a_covering_grant() -> Result<()> {
    let dtq = start().await?;
    // The attack of the issue: code of its choosing, another tenant's
    // namespace, a private range, no quota.
    let evil = [
        ("namespace", "billing"),
        ("allow_hosts", "http://10.0.0.1:*"),
        ("kv_quota_mib", "0"),
    ];
    let refused = deploy(&dtq, "evil", &evil, QUEUE_ADMIN).await?;
    assert_forbidden(&refused, "deploy", None);
    assert_forbidden(
        &deploy(&dtq, "evil", &[], QUEUE_ADMIN).await?,
        "deploy",
        None,
    );
    let (status, body) = call(&dtq, Method::GET, "/v1/handlers/evil", None, READER).await?;
    assert_eq!(status, 400, "nothing was deployed: {body}");

    let (status, body) = deploy(&dtq, "greeter", &[("namespace", "mail")], DEPLOYER).await?;
    assert_eq!(status, 201, "{body}");
    let (status, body) = deploy(&dtq, "evil", &evil, OPERATOR).await?;
    assert_eq!(status, 201, "the operator may: {body}");
    Ok(())
}

/// A deploy a grant refuses: task, settings, and the detail naming what it
/// does not cover, with its value.
type Refused<'a> = (&'a str, &'a [(&'a str, &'a str)], &'a str, Value);

#[tokio::test(flavor = "multi_thread")]
async fn a_deploy_grant_deploys_only_within_its_limits() -> Result<()> {
    let dtq = start().await?;
    let ok = [
        ("namespace", "mail"),
        ("allow_hosts", "https://api.mailer.example"),
        ("kv_quota_mib", "4"),
    ];
    let (status, body) = deploy(&dtq, "greeter", &ok, DEPLOYER).await?;
    assert_eq!(status, 201, "{body}");
    let before = handler(&dtq, "greeter").await?;

    let outside: [Refused<'_>; 7] = [
        (
            "payments",
            &[("namespace", "mail")],
            "task",
            json!("payments"),
        ),
        (
            "greeter",
            &[("namespace", "billing")],
            "namespace",
            json!("billing"),
        ),
        // Without `namespace` a task runs in its own, which the grant
        // does not name either.
        ("greeter", &[], "namespace", json!("greeter")),
        (
            "greeter",
            &[
                ("namespace", "mail"),
                (
                    "allow_hosts",
                    "https://api.mailer.example,http://10.0.0.1:*",
                ),
            ],
            "host",
            json!("http://10.0.0.1:*"),
        ),
        (
            "greeter",
            &[("namespace", "mail"), ("kv_quota_mib", "0")],
            "kv_quota_mib",
            json!(0),
        ),
        (
            "greeter",
            &[("namespace", "mail"), ("kv_quota_mib", "5")],
            "kv_quota_mib",
            json!(5),
        ),
        // Submitting to queues reaches other tenants: the operator's to
        // grant, whatever the deploy grant covers.
        (
            "greeter",
            &[("namespace", "mail"), ("submit_to", "mail")],
            "submit_to",
            json!("mail"),
        ),
    ];
    for (task, settings, field, value) in outside {
        let refused = deploy(&dtq, task, settings, DEPLOYER).await?;
        assert_forbidden(&refused, "deploy", Some((field, value)));
    }
    assert_eq!(
        handler(&dtq, "greeter").await?,
        before,
        "a refused deploy changed the registry"
    );
    let (status, _) = call(&dtq, Method::GET, "/v1/handlers/payments", None, READER).await?;
    assert_eq!(status, 400, "payments was never deployed");

    // A prefix of `tasks=`.
    let (status, body) = deploy(&dtq, "mail-digest", &[("namespace", "mail")], DEPLOYER).await?;
    assert_eq!(status, 201, "{body}");
    // The operator grants submission.
    let granted = [("namespace", "mail"), ("submit_to", "mail")];
    let (status, body) = deploy(&dtq, "greeter", &granted, OPERATOR).await?;
    assert_eq!(status, 201, "{body}");
    assert_eq!(body["settings"]["submit_to"], json!("mail"), "{body}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn rollback_is_checked_as_a_deploy_of_the_version_it_restores() -> Result<()> {
    let dtq = start().await?;
    let rollback = "/v1/handlers/greeter/rollback";
    // v1 by the operator in `billing`; v2 by the deploy grant in `mail`.
    let (status, body) = deploy(&dtq, "greeter", &[("namespace", "billing")], OPERATOR).await?;
    assert_eq!(status, 201, "{body}");
    let (status, body) = deploy(&dtq, "greeter", &[("namespace", "mail")], DEPLOYER).await?;
    assert_eq!(status, 201, "{body}");
    let before = handler(&dtq, "greeter").await?;

    let refused = call(&dtq, Method::POST, rollback, None, QUEUE_ADMIN).await?;
    assert_forbidden(&refused, "deploy", None);
    // Rolling back to v1 would put the task in `billing`.
    let refused = call(&dtq, Method::POST, rollback, None, DEPLOYER).await?;
    assert_forbidden(&refused, "deploy", Some(("namespace", json!("billing"))));
    assert_eq!(
        handler(&dtq, "greeter").await?,
        before,
        "a refused rollback changed the registry"
    );

    // v3 in `mail` too: rolling back to v2 is the grant's to do.
    let v3 = [("namespace", "mail"), ("max_attempts", "3")];
    let (status, body) = deploy(&dtq, "greeter", &v3, DEPLOYER).await?;
    assert_eq!(status, 201, "{body}");
    let (status, body) = call(&dtq, Method::POST, rollback, None, DEPLOYER).await?;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["settings"], json!({"namespace": "mail"}), "{body}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn undeploy_refuses_a_queue_admin_and_tasks_outside_the_grant() -> Result<()> {
    let dtq = start().await?;
    for task in ["greeter", "payments"] {
        let (status, body) = deploy(&dtq, task, &[], OPERATOR).await?;
        assert_eq!(status, 201, "{body}");
    }
    let refused = call(
        &dtq,
        Method::DELETE,
        "/v1/handlers/greeter",
        None,
        QUEUE_ADMIN,
    )
    .await?;
    assert_forbidden(&refused, "deploy", None);
    let refused = call(
        &dtq,
        Method::DELETE,
        "/v1/handlers/payments",
        None,
        DEPLOYER,
    )
    .await?;
    assert_forbidden(&refused, "deploy", Some(("task", json!("payments"))));
    for task in ["greeter", "payments"] {
        let active = &handler(&dtq, task).await?["active"];
        assert!(
            active["digest"].is_string(),
            "{task} is still deployed: {active}"
        );
    }
    let (status, body) = call(&dtq, Method::DELETE, "/v1/handlers/greeter", None, DEPLOYER).await?;
    assert_eq!((status, &body["undeployed"]), (200, &json!(true)), "{body}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn partitions_need_admin_on_every_queue() -> Result<()> {
    let dtq = start().await?;
    let path = "/v1/queues/emails/partitions";
    let body = Some(json!({"count": 4}));
    let refused = call(&dtq, Method::PUT, path, body.clone(), QUEUE_ADMIN).await?;
    assert_forbidden(&refused, "admin", Some(("queues", json!("*"))));
    let (status, stats) = call(&dtq, Method::GET, "/v1/queues/emails", None, QUEUE_ADMIN).await?;
    assert_eq!((status, &stats["partitions"]), (200, &json!(1)), "{stats}");

    let (status, raised) = call(&dtq, Method::PUT, path, body, OPERATOR).await?;
    assert_eq!(
        (status, &raised["partitions"]),
        (200, &json!(4)),
        "{raised}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn setting_a_schedule_needs_its_queue_and_its_task() -> Result<()> {
    let dtq = start().await?;
    let path = "/v1/queues/emails/schedules/nightly";
    let echo = json!({"cron": "0 3 * * *", "task": "echo"});
    let refused = call(&dtq, Method::PUT, path, Some(echo.clone()), QUEUE_ADMIN).await?;
    assert_forbidden(&refused, "admin", Some(("task", json!("echo"))));
    let (_, listed) = call(
        &dtq,
        Method::GET,
        "/v1/queues/emails/schedules",
        None,
        QUEUE_ADMIN,
    )
    .await?;
    assert_eq!(
        listed["schedules"],
        json!([]),
        "a refused schedule was written"
    );

    // Granted `echo` on `emails`: that, and only that.
    let (status, body) = call(&dtq, Method::PUT, path, Some(echo.clone()), MAIL_ADMIN).await?;
    assert_eq!(status, 201, "{body}");
    let other = "/v1/queues/other/schedules/nightly";
    let refused = call(&dtq, Method::PUT, other, Some(echo), MAIL_ADMIN).await?;
    assert_forbidden(&refused, "admin", Some(("queue", json!("other"))));
    let (status, body) = deploy(&dtq, "greeter", &[], OPERATOR).await?;
    assert_eq!(status, 201, "{body}");
    let greeter = json!({"cron": "0 3 * * *", "task": "greeter"});
    let refused = call(&dtq, Method::PUT, path, Some(greeter.clone()), MAIL_ADMIN).await?;
    assert_forbidden(&refused, "admin", Some(("task", json!("greeter"))));
    let (status, body) = call(&dtq, Method::PUT, path, Some(greeter), OPERATOR).await?;
    assert_eq!(status, 200, "the operator may: {body}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn deleting_a_schedule_needs_its_queue_and_its_task() -> Result<()> {
    let dtq = start().await?;
    let path = "/v1/queues/emails/schedules/nightly";
    let echo = json!({"cron": "0 3 * * *", "task": "echo"});
    let (status, body) = call(&dtq, Method::PUT, path, Some(echo), OPERATOR).await?;
    assert_eq!(status, 201, "{body}");

    let refused = call(&dtq, Method::DELETE, path, None, QUEUE_ADMIN).await?;
    assert_forbidden(&refused, "admin", Some(("task", json!("echo"))));
    let (_, listed) = call(
        &dtq,
        Method::GET,
        "/v1/queues/emails/schedules",
        None,
        QUEUE_ADMIN,
    )
    .await?;
    assert_eq!(listed["schedules"][0]["name"], "nightly", "{listed}");

    let (status, body) = call(&dtq, Method::DELETE, path, None, MAIL_ADMIN).await?;
    assert_eq!((status, &body["deleted"]), (200, &json!(true)), "{body}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_queue_admin_keeps_its_queues_own_powers() -> Result<()> {
    let dtq = start().await?;
    let (status, body) = call(
        &dtq,
        Method::POST,
        "/v1/queues/emails/tasks",
        Some(json!({"task": "echo", "payload": 1})),
        QUEUE_ADMIN,
    )
    .await?;
    assert_eq!(status, 202, "{body}");
    let id = body["task_id"].as_str().context("task_id")?;
    let requeue = format!("/v1/queues/emails/dlq/{id}/requeue");
    assert_error(
        &call(&dtq, Method::POST, &requeue, None, QUEUE_ADMIN).await?,
        409,
        "NOT_DEAD_LETTERED",
    );
    let (status, body) = call(
        &dtq,
        Method::DELETE,
        "/v1/queues/emails/dlq",
        Some(json!({"all": true})),
        QUEUE_ADMIN,
    )
    .await?;
    assert_eq!(status, 200, "{body}");
    let (status, _) = call(
        &dtq,
        Method::DELETE,
        "/v1/queues/other/dlq",
        Some(json!({"all": true})),
        QUEUE_ADMIN,
    )
    .await?;
    assert_eq!(status, 403);
    Ok(())
}
