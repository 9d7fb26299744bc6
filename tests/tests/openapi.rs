//! The OpenAPI document at `GET /v1/openapi.json` against the API that
//! serves it (issue 13): it is OpenAPI 3.1 whose every `$ref` resolves;
//! every operation in it is served, and every route served is in it; the
//! README's routes table lists exactly its operations; real responses
//! validate against the schemas it gives them.
//!
//! Each test runs a whole dtq (API and worker, `dtq_tests::Dtq`) on a
//! loopback port against its own real `redis-server`, with one token of
//! every scope, so that each probe reaches the route's own checks.

use std::collections::BTreeSet;

use anyhow::{Context, Result, bail, ensure};
use dtq_tests::Dtq;
use reqwest::Method;
use serde_json::{Value, json};

/// The test token: every scope (`*`), every queue.
const TOKEN: &str = "openapi-test-token-0123456789abcdef0123";

/// The queue the tests submit to.
const QUEUE: &str = "openapi";

/// Longest the echo task may take to run before it is a failure.
const GUARD: std::time::Duration = std::time::Duration::from_secs(30);

/// The methods a route may be served with (HEAD and OPTIONS follow GET and
/// the router's own handling; they are not routes of their own).
const METHODS: [&str; 5] = ["get", "post", "put", "delete", "patch"];

/// Error codes of the router's own answers for what is no route: a route's
/// own 404 or 405 has another code (`TASK_NOT_FOUND`, `UNKNOWN_VERSION`).
const NO_ROUTE: [&str; 2] = ["NOT_FOUND", "METHOD_NOT_ALLOWED"];

/// Paths the server serves outside the API and its document: the web
/// UI's pages and files, which are HTML, not API operations. The README
/// may list them; the comparison with the document leaves them out.
const OUTSIDE_THE_DOCUMENT: [&str; 1] = ["/ui"];

async fn start() -> Result<Dtq> {
    let tokens = format!("{TOKEN} *");
    let flows = format!("flows={QUEUE}:flows");
    Dtq::start(
        true,
        &[
            "--tokens",
            &tokens,
            "--queues",
            QUEUE,
            "--submit-to",
            &flows,
        ],
    )
    .await
}

/// A request with the test token; the status and the body's text.
async fn request(
    dtq: &Dtq,
    method: &str,
    path: &str,
    body: Option<Value>,
) -> Result<(u16, reqwest::Response)> {
    let method = Method::from_bytes(method.to_ascii_uppercase().as_bytes())?;
    let mut req = reqwest::Client::new()
        .request(method, format!("{}{path}", dtq.api))
        .bearer_auth(TOKEN);
    if let Some(body) = body {
        req = req.json(&body);
    }
    let resp = req.send().await?;
    Ok((resp.status().as_u16(), resp))
}

/// A request whose answer is JSON: the status and the body.
async fn call(dtq: &Dtq, method: &str, path: &str, body: Option<Value>) -> Result<(u16, Value)> {
    let (status, resp) = request(dtq, method, path, body).await?;
    let text = resp.text().await?;
    let body = serde_json::from_str(&text)
        .with_context(|| format!("{method} {path}: {status}, not JSON: {text:?}"))?;
    Ok((status, body))
}

/// The document, fetched without a token.
async fn document(dtq: &Dtq) -> Result<Value> {
    let resp = reqwest::get(format!("{}/v1/openapi.json", dtq.api)).await?;
    ensure!(
        resp.status() == 200,
        "GET /v1/openapi.json: {}",
        resp.status()
    );
    let content_type = resp
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    ensure!(
        content_type.starts_with("application/json"),
        "{content_type}"
    );
    Ok(resp.json().await?)
}

/// Every (method, path) of the document, methods in lower case.
fn operations(doc: &Value) -> BTreeSet<(String, String)> {
    let mut ops = BTreeSet::new();
    for (path, item) in doc["paths"].as_object().into_iter().flatten() {
        for method in METHODS {
            if item.get(method).is_some() {
                ops.insert((method.to_owned(), path.clone()));
            }
        }
    }
    ops
}

/// `path` with each `{param}` filled with a valid value; `probe` names
/// nothing that exists, so a route answers its own "no such" error.
fn filled(path: &str) -> String {
    path.split('/')
        .map(|segment| {
            let param = segment.strip_prefix('{').and_then(|s| s.strip_suffix('}'));
            match param {
                Some("queue") => QUEUE,
                Some(_) => "probe",
                None => segment,
            }
        })
        .collect::<Vec<_>>()
        .join("/")
}

/// Whether `(status, body)` is the router's "no such route" or "no such
/// method", rather than a route's own answer.
fn is_no_route(status: u16, body: &str) -> bool {
    let code = serde_json::from_str::<Value>(body)
        .ok()
        .and_then(|v| v["error"]["code"].as_str().map(str::to_owned));
    matches!(status, 404 | 405) && code.is_some_and(|c| NO_ROUTE.contains(&c.as_str()))
}

/// A request to `method path` (parameters filled; a minimal body for
/// methods that take one): `Some((status, body))` when the router has no
/// route for it, `None` when a route answered.
async fn probe(dtq: &Dtq, method: &str, path: &str) -> Result<Option<(u16, String)>> {
    let body = matches!(method, "post" | "put" | "patch").then(|| json!({}));
    let (status, resp) = request(dtq, method, &filled(path), body).await?;
    let streaming = resp
        .headers()
        .get("content-type")
        .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
    if streaming {
        // An event stream has no end: its headers are the route's answer.
        return Ok(None);
    }
    let text = resp.text().await?;
    Ok(is_no_route(status, &text).then_some((status, text)))
}

#[tokio::test]
async fn the_document_is_openapi_3_1_and_every_ref_resolves() -> Result<()> {
    let dtq = start().await?;
    let doc = document(&dtq).await?;
    let version = doc["openapi"].as_str().context("no `openapi` field")?;
    ensure!(version.starts_with("3.1."), "openapi: {version}");
    ensure!(doc["info"]["title"] == "dtq", "{}", doc["info"]);
    ensure!(
        doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer",
        "no bearer scheme: {}",
        doc["components"]["securitySchemes"]
    );

    let mut refs = Vec::new();
    collect_refs(&doc, &mut refs);
    ensure!(!refs.is_empty(), "the document has no $ref at all");
    let broken: Vec<&String> = refs
        .iter()
        .filter(|r| {
            r.strip_prefix('#')
                .is_none_or(|pointer| doc.pointer(pointer).is_none())
        })
        .collect();
    ensure!(
        broken.is_empty(),
        "$refs that resolve to nothing: {broken:?}"
    );

    // The error body and its codes are schemas of their own.
    let schemas = &doc["components"]["schemas"];
    ensure!(
        schemas["ErrorCode"]["enum"]
            .as_array()
            .is_some_and(|codes| codes.contains(&json!("QUEUE_FULL"))),
        "{}",
        schemas["ErrorCode"]
    );
    ensure!(
        schemas["ErrorBody"]["properties"]["error"]["$ref"] == "#/components/schemas/ErrorDetail",
        "{}",
        schemas["ErrorBody"]
    );
    // Every operation but the document and the health check takes the
    // bearer token; the event stream is documented as one.
    for (method, path) in operations(&doc) {
        let operation = &doc["paths"][&path][&method];
        let bearer = operation["security"].to_string().contains("\"bearer\"");
        let open = ["/v1/openapi.json", "/healthz"].contains(&path.as_str());
        ensure!(
            bearer != open,
            "{method} {path}: security {}",
            operation["security"]
        );
    }
    let events = &doc["paths"]["/v1/queues/{queue}/events"]["get"]["responses"]["200"]["content"];
    ensure!(events.get("text/event-stream").is_some(), "{events}");
    Ok(())
}

/// Every `$ref` in `value`.
fn collect_refs(value: &Value, refs: &mut Vec<String>) {
    match value {
        Value::Object(fields) => {
            for (name, v) in fields {
                match (name.as_str(), v) {
                    ("$ref", Value::String(r)) => refs.push(r.clone()),
                    _ => collect_refs(v, refs),
                }
            }
        }
        Value::Array(items) => items.iter().for_each(|v| collect_refs(v, refs)),
        _ => {}
    }
}

/// Every operation has an `operationId` of its own, as OpenAPI requires and
/// client generators rely on (each names a method of the client).
#[tokio::test]
async fn every_operation_has_an_id_of_its_own() -> Result<()> {
    let dtq = start().await?;
    let doc = document(&dtq).await?;
    let mut seen = std::collections::BTreeMap::new();
    for (path, item) in doc["paths"].as_object().context("paths")? {
        for (method, op) in item.as_object().context("a path item")? {
            if !["get", "put", "post", "delete", "patch", "head", "options"].contains(&&**method) {
                continue;
            }
            let id = op["operationId"]
                .as_str()
                .with_context(|| format!("{method} {path} has no operationId"))?;
            if let Some(other) = seen.insert(id.to_owned(), format!("{method} {path}")) {
                bail!("operationId {id:?} names both {other} and {method} {path}");
            }
        }
    }
    Ok(())
}

/// The document passes a real validator: `openapi-spec-validator` (pinned),
/// installed from PyPI into a venv of this test's own.
#[tokio::test]
async fn the_document_passes_openapi_spec_validator() -> Result<()> {
    let dtq = start().await?;
    let doc = document(&dtq).await?;
    let dir = dtq_tests::TempDir::new("openapi-validator")?;
    let file = dir.path.join("dtq.json");
    std::fs::write(&file, serde_json::to_vec_pretty(&doc)?)?;
    let venv = dir.path.join("venv");
    let run = |program: &std::path::Path, args: &[&std::ffi::OsStr]| -> Result<String> {
        let out = std::process::Command::new(program)
            .args(args)
            .output()
            .with_context(|| format!("cannot run {}", program.display()))?;
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        ensure!(
            out.status.success(),
            "{}: {}\n{text}",
            program.display(),
            out.status
        );
        Ok(text)
    };
    run(
        "python3".as_ref(),
        &["-m".as_ref(), "venv".as_ref(), venv.as_os_str()],
    )?;
    run(
        &venv.join("bin/pip"),
        &["install", "--quiet", "openapi-spec-validator==0.9.0"].map(std::ffi::OsStr::new),
    )?;
    let said = run(
        &venv.join("bin/openapi-spec-validator"),
        &[file.as_os_str()],
    )?;
    ensure!(said.contains("OK"), "the validator said: {said}");
    Ok(())
}

#[tokio::test]
async fn every_documented_operation_is_served() -> Result<()> {
    let dtq = start().await?;
    let doc = document(&dtq).await?;
    let mut unserved = Vec::new();
    for (method, path) in operations(&doc) {
        if let Some((status, body)) = probe(&dtq, &method, &path).await? {
            unserved.push(format!("{} {path}: {status} {body}", method.to_uppercase()));
        }
    }
    ensure!(
        unserved.is_empty(),
        "documented operations the router has no route for:\n{}",
        unserved.join("\n")
    );
    // The probe tells a route's own 404 from the router's.
    let (status, body) = call(
        &dtq,
        "get",
        &format!("/v1/queues/{QUEUE}/tasks/probe"),
        None,
    )
    .await?;
    ensure!(!is_no_route(status, &body.to_string()), "{status} {body}");
    let (status, body) = call(&dtq, "get", "/v1/no-such-route", None).await?;
    ensure!(is_no_route(status, &body.to_string()), "{status} {body}");
    Ok(())
}

#[tokio::test]
async fn every_served_route_is_documented() -> Result<()> {
    let dtq = start().await?;
    let doc = document(&dtq).await?;
    let documented = operations(&doc);
    // The route table's paths: the document's, and those of routes
    // registered without an annotation.
    let mut paths: BTreeSet<String> = documented.iter().map(|(_, p)| p.clone()).collect();
    paths.extend(dtq_host::api::openapi::undocumented_paths());
    let mut undocumented = Vec::new();
    for path in &paths {
        for method in METHODS {
            if documented.contains(&(method.to_owned(), path.clone())) {
                continue;
            }
            if probe(&dtq, method, path).await?.is_none() {
                undocumented.push(format!("{} {path}", method.to_uppercase()));
            }
        }
    }
    ensure!(
        undocumented.is_empty(),
        "routes served but not in the OpenAPI document (annotate the handler with \
         #[utoipa::path] and register it with `.routes(routes!(handler))` in \
         host/src/api/mod.rs `route_table`):\n{}",
        undocumented.join("\n")
    );
    Ok(())
}

/// The operations the README's routes table lists: each backquoted
/// `METHOD /path` of a row's first cell, without its query string.
fn readme_operations() -> Result<BTreeSet<(String, String)>> {
    let readme = include_str!("../../README.md");
    let start = readme
        .find("\n## HTTP API\n")
        .context("README.md has no `## HTTP API` section")?;
    let section = &readme[start + 1..];
    let section = &section[..section[1..].find("\n## ").map_or(section.len(), |i| i + 1)];
    let mut ops = BTreeSet::new();
    let rows = section
        .lines()
        .skip_while(|l| !l.starts_with("| route"))
        .skip(2)
        .take_while(|l| l.starts_with('|'));
    for row in rows {
        let first_cell = row.split('|').nth(1).unwrap_or_default();
        for quoted in first_cell.split('`').skip(1).step_by(2) {
            let Some((method, target)) = quoted.split_once(' ') else {
                continue;
            };
            if !METHODS.contains(&method.to_ascii_lowercase().as_str()) {
                continue;
            }
            let path = target.split('?').next().unwrap_or_default().trim();
            ops.insert((method.to_ascii_lowercase(), path.to_owned()));
        }
    }
    ensure!(
        !ops.is_empty(),
        "no routes found in README.md's routes table"
    );
    Ok(ops)
}

#[tokio::test]
async fn the_readme_lists_exactly_the_documented_operations() -> Result<()> {
    let dtq = start().await?;
    let doc = document(&dtq).await?;
    let outside = |(_, path): &&(String, String)| {
        OUTSIDE_THE_DOCUMENT
            .iter()
            .any(|prefix| path == prefix || path.starts_with(&format!("{prefix}/")))
    };
    let documented = operations(&doc);
    let listed: BTreeSet<(String, String)> = readme_operations()?
        .iter()
        .filter(|op| !outside(op))
        .cloned()
        .collect();
    let show = |ops: Vec<&(String, String)>| -> String {
        if ops.is_empty() {
            return "  (none)".into();
        }
        ops.iter()
            .map(|(m, p)| format!("  {} {p}", m.to_uppercase()))
            .collect::<Vec<_>>()
            .join("\n")
    };
    let only_readme: Vec<_> = listed.difference(&documented).collect();
    let only_doc: Vec<_> = documented.difference(&listed).collect();
    if !only_readme.is_empty() || !only_doc.is_empty() {
        bail!(
            "README.md's routes table and /v1/openapi.json disagree\n\
             in the README, not in the document:\n{}\n\
             in the document, not in the README:\n{}",
            show(only_readme),
            show(only_doc)
        );
    }
    Ok(())
}

/// Validates responses against the document's schemas. Every object
/// schema is closed (`additionalProperties: false` where it says nothing),
/// so a field a route sends and its schema does not list fails too.
struct Validator {
    doc: Value,
}

/// Where the schemas are put for the validator: a resource of their own.
const SCHEMAS_URL: &str = "http://dtq.test/schemas.json";

impl Validator {
    fn new(doc: Value) -> Self {
        Validator { doc }
    }

    /// Check `body`, answered with `status` by `method path`, against the
    /// schema the document gives that response.
    fn check(&self, method: &str, path: &str, status: u16, body: &Value) -> Result<()> {
        let response = &self.doc["paths"][path][method]["responses"][status.to_string()];
        let schema = response["content"]["application/json"]["schema"].clone();
        ensure!(
            schema.is_object(),
            "{method} {path}: the document has no JSON schema for {status}: {response}"
        );
        let mut defs = self.doc["components"]["schemas"].clone();
        defs["__response"] = schema;
        close_objects(&mut defs);
        let mut root = json!({
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "$defs": defs,
        });
        rewrite_refs(&mut root);
        let mut schemas = boon::Schemas::new();
        let mut compiler = boon::Compiler::new();
        compiler.set_default_draft(boon::Draft::V2020_12);
        compiler
            .add_resource(SCHEMAS_URL, root)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let index = compiler
            .compile(&format!("{SCHEMAS_URL}#/$defs/__response"), &mut schemas)
            .map_err(|e| anyhow::anyhow!("{method} {path} {status}: schema: {e:#}"))?;
        if let Err(e) = schemas.validate(body, index) {
            bail!(
                "{} {path} answered {status} with a body its schema refuses:\n{e:#}\nbody: {body:#}",
                method.to_uppercase()
            );
        }
        Ok(())
    }
}

/// `additionalProperties: false` on every object schema with properties
/// that does not say otherwise.
fn close_objects(value: &mut Value) {
    match value {
        Value::Object(fields) => {
            if fields.get("properties").is_some_and(Value::is_object)
                && !fields.contains_key("additionalProperties")
            {
                fields.insert("additionalProperties".into(), json!(false));
            }
            fields.values_mut().for_each(close_objects);
        }
        Value::Array(items) => items.iter_mut().for_each(close_objects),
        _ => {}
    }
}

/// `#/components/schemas/X` → `#/$defs/X`.
fn rewrite_refs(value: &mut Value) {
    match value {
        Value::Object(fields) => {
            for (name, v) in fields.iter_mut() {
                match v {
                    Value::String(r) if name == "$ref" => {
                        if let Some(rest) = r.strip_prefix("#/components/schemas/") {
                            *r = format!("#/$defs/{rest}");
                        }
                    }
                    _ => rewrite_refs(v),
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(rewrite_refs),
        _ => {}
    }
}

#[tokio::test]
async fn real_responses_validate_against_their_schemas() -> Result<()> {
    let dtq = start().await?;
    let v = Validator::new(document(&dtq).await?);
    let tasks = "/v1/queues/{queue}/tasks";
    let task = "/v1/queues/{queue}/tasks/{id}";
    let submit_path = format!("/v1/queues/{QUEUE}/tasks");
    let submission = json!({"task": "echo", "payload": {"n": 1}, "idempotency_key": "k-1"});

    // A new task, 202.
    let (status, body) = call(&dtq, "post", &submit_path, Some(submission.clone())).await?;
    ensure!(status == 202, "{status} {body}");
    v.check("post", tasks, status, &body)?;
    let id = body["task_id"].as_str().context("no task_id")?.to_owned();

    // The task, once it ran: result, log, digests, timestamps.
    let task_path = format!("/v1/queues/{QUEUE}/tasks/{id}");
    let started = std::time::Instant::now();
    let done = loop {
        let (status, body) = call(&dtq, "get", &task_path, None).await?;
        ensure!(status == 200, "{status} {body}");
        v.check("get", task, status, &body)?;
        if body["status"] == "SUCCEEDED" {
            break body;
        }
        ensure!(
            started.elapsed() < GUARD,
            "the echo task did not succeed within {GUARD:?}: {body:#}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    };

    // A replay of the terminal key, 200 with the stored task.
    let (status, body) = call(&dtq, "post", &submit_path, Some(submission)).await?;
    ensure!(
        status == 200 && body["duplicate"] == true,
        "{status} {body}"
    );
    v.check("post", tasks, status, &body)?;

    // A parent (flows) and one of its children: `children`, `parent`.
    let parent =
        json!({"task": "flows", "payload": {"fan_out": 2, "queue": QUEUE, "task": "flows"}});
    let (status, body) = call(&dtq, "post", &submit_path, Some(parent)).await?;
    ensure!(status == 202, "{status} {body}");
    let parent_path = format!(
        "/v1/queues/{QUEUE}/tasks/{}",
        body["task_id"].as_str().unwrap_or("")
    );
    let started = std::time::Instant::now();
    let parent = loop {
        let (status, body) = call(&dtq, "get", &parent_path, None).await?;
        ensure!(status == 200, "{status} {body}");
        v.check("get", task, status, &body)?;
        if body["status"] == "SUCCEEDED" {
            break body;
        }
        ensure!(
            started.elapsed() < GUARD,
            "the parent did not succeed: {body:#}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    };
    let child = parent["children"][0]["task_id"]
        .as_str()
        .context("a child")?;
    let (status, body) = call(
        &dtq,
        "get",
        &format!("/v1/queues/{QUEUE}/tasks/{child}"),
        None,
    )
    .await?;
    ensure!(
        status == 200 && body["parent"].is_object(),
        "{status} {body}"
    );
    v.check("get", task, status, &body)?;

    // A queue's counts, every queue's, a page of tasks.
    let (status, body) = call(&dtq, "get", &format!("/v1/queues/{QUEUE}"), None).await?;
    ensure!(status == 200, "{status} {body}");
    v.check("get", "/v1/queues/{queue}", status, &body)?;
    let (status, body) = call(&dtq, "get", "/v1/queues", None).await?;
    ensure!(status == 200, "{status} {body}");
    v.check("get", "/v1/queues", status, &body)?;
    let (status, body) = call(&dtq, "get", &submit_path, None).await?;
    ensure!(status == 200, "{status} {body}");
    v.check("get", tasks, status, &body)?;

    // Errors: a route's own 404, a 400, a 409.
    let (status, body) = call(&dtq, "get", &format!("/v1/queues/{QUEUE}/tasks/nope"), None).await?;
    ensure!(
        status == 404 && body["error"]["code"] == "TASK_NOT_FOUND",
        "{status} {body}"
    );
    v.check("get", task, status, &body)?;
    let (status, body) = call(&dtq, "post", &submit_path, Some(json!({"task": 1}))).await?;
    ensure!(status == 400, "{status} {body}");
    v.check("post", tasks, status, &body)?;
    let cancel = format!("/v1/queues/{QUEUE}/tasks/{id}/cancel");
    let (status, body) = call(&dtq, "post", &cancel, None).await?;
    ensure!(
        status == 409 && body["error"]["code"] == "TASK_TERMINAL",
        "{status} {body}"
    );
    v.check(
        "post",
        "/v1/queues/{queue}/tasks/{id}/cancel",
        status,
        &body,
    )?;

    // The check does catch a body that strays from its schema.
    let mut strayed = done.clone();
    strayed["not_documented"] = json!(true);
    ensure!(
        v.check("get", task, 200, &strayed).is_err(),
        "an undocumented field passed"
    );
    let mut strayed = done;
    strayed["attempts"] = json!("one");
    ensure!(
        v.check("get", task, 200, &strayed).is_err(),
        "a mistyped field passed"
    );
    Ok(())
}

/// The operations of `doc` whose `security` names the bearer token.
fn with_bearer(doc: &Value) -> BTreeSet<(String, String)> {
    operations(doc)
        .into_iter()
        .filter(|(method, path)| {
            doc["paths"][path][method]["security"]
                .to_string()
                .contains("\"bearer\"")
        })
        .collect()
}

/// The document says what the server it comes from does with tokens: a
/// server without any serves every operation openly, and its document
/// declares no bearer token and no 401; with only an admin token, the
/// admin and fleet operations take it and no other; with scoped tokens,
/// every operation but the document and the health check. The document
/// with tokens names each operation's scope.
#[tokio::test]
async fn the_document_declares_the_tokens_the_server_takes() -> Result<()> {
    let open = Dtq::start(false, &[]).await?;
    let doc = document(&open).await?;
    let declared = with_bearer(&doc);
    ensure!(
        declared.is_empty(),
        "an open API declares tokens on {declared:?}"
    );
    ensure!(
        doc["components"]["securitySchemes"].get("bearer").is_none(),
        "{}",
        doc["components"]["securitySchemes"]
    );
    for (method, path) in operations(&doc) {
        let responses = &doc["paths"][&path][&method]["responses"];
        ensure!(
            responses.get("401").is_none(),
            "{method} {path}: {responses}"
        );
    }
    // And the server does serve them without a token.
    let resp = reqwest::get(format!("{}/v1/queues/{QUEUE}/tasks", open.api)).await?;
    ensure!(resp.status() == 200, "{}", resp.status());
    drop(open);

    let admin_only = Dtq::start(false, &["--admin-token", TOKEN]).await?;
    let doc = document(&admin_only).await?;
    let admin_ops: BTreeSet<(String, String)> = [
        ("put", "/v1/queues/{queue}/partitions"),
        ("post", "/v1/queues/{queue}/pause"),
        ("post", "/v1/queues/{queue}/resume"),
        ("put", "/v1/queues/{queue}/limits"),
        ("delete", "/v1/queues/{queue}/limits"),
        ("post", "/v1/queues/{queue}/dlq/{id}/requeue"),
        ("post", "/v1/queues/{queue}/dlq/requeue"),
        ("delete", "/v1/queues/{queue}/dlq"),
        ("put", "/v1/queues/{queue}/schedules/{name}"),
        ("delete", "/v1/queues/{queue}/schedules/{name}"),
        ("put", "/v1/handlers/{task}"),
        ("post", "/v1/handlers/{task}/rollback"),
        ("delete", "/v1/handlers/{task}"),
    ]
    .iter()
    .map(|(m, p)| (m.to_string(), p.to_string()))
    .collect();
    ensure!(
        with_bearer(&doc) == admin_ops,
        "with only an admin token: {:?}",
        with_bearer(&doc)
    );
    drop(admin_only);

    let scoped = start().await?;
    let doc = document(&scoped).await?;
    let submit = &doc["paths"]["/v1/queues/{queue}/tasks"]["post"]["security"];
    ensure!(submit == &json!([{"bearer": ["submit"]}]), "{submit}");
    let purge = &doc["paths"]["/v1/queues/{queue}/dlq"]["delete"]["security"];
    ensure!(purge == &json!([{"bearer": ["admin"]}]), "{purge}");
    ensure!(
        with_bearer(&doc).len() + 2 == operations(&doc).len(),
        "{:?}",
        with_bearer(&doc)
    );
    Ok(())
}

/// What schemathesis found where the server, not the document, was wrong
/// (`tests/tests/openapi_tools.rs` runs it): a JSON `null` body on the DLQ
/// purge and the rollback is no body, as the document's nullable bodies
/// say; a task id of a bulk DLQ route is bounded in characters, as its
/// schema's `maxLength`; a listing cursor of `0-0`, which no page gives,
/// is `INVALID_CURSOR` rather than a Redis error answered 503.
#[tokio::test]
async fn null_bodies_id_lengths_and_the_first_cursor_are_answered_as_documented() -> Result<()> {
    let dtq = start().await?;
    let purge = format!("/v1/queues/{QUEUE}/dlq?older_than_ms=0");
    let (status, body) = call(&dtq, "delete", &purge, Some(Value::Null)).await?;
    ensure!(status == 200 && body["purged"] == 0, "{status} {body}");

    let rollback = "/v1/handlers/never-deployed/rollback";
    let (status, body) = call(&dtq, "post", rollback, Some(Value::Null)).await?;
    ensure!(
        status == 400 && body["error"]["code"] == "UNKNOWN_TASK",
        "{status} {body}"
    );

    // 200 characters of two bytes each: within the schema's 200.
    let id = "é".repeat(200);
    let requeue = format!("/v1/queues/{QUEUE}/dlq/requeue");
    let (status, body) = call(&dtq, "post", &requeue, Some(json!({"ids": [id]}))).await?;
    ensure!(status == 200 && body["requeued"] == 0, "{status} {body}");
    let (status, body) = call(
        &dtq,
        "post",
        &requeue,
        Some(json!({"ids": ["x".repeat(201)]})),
    )
    .await?;
    ensure!(
        status == 400 && body["error"]["code"] == "INVALID_REQUEST",
        "{status} {body}"
    );

    for cursor in ["0", "0-0", "0-0.1"] {
        let page = format!("/v1/queues/{QUEUE}/tasks?cursor={cursor}");
        let (status, body) = call(&dtq, "get", &page, None).await?;
        ensure!(
            status == 400 && body["error"]["code"] == "INVALID_CURSOR",
            "{cursor}: {status} {body}"
        );
    }
    let doc = document(&dtq).await?;
    let cursor = doc["paths"]["/v1/queues/{queue}/tasks"]["get"]["parameters"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p["name"] == "cursor")
        .context("no cursor parameter")?;
    ensure!(cursor["schema"]["pattern"].is_string(), "{cursor}");
    Ok(())
}

/// Names carry the pattern and length the server holds them to: queue,
/// task and schedule names in paths and in the submission's body.
#[tokio::test]
async fn names_are_documented_with_the_rule_the_server_checks() -> Result<()> {
    let dtq = start().await?;
    let doc = document(&dtq).await?;
    let name = json!({"type": "string", "maxLength": 64, "minLength": 1, "pattern": "^[A-Za-z0-9_.-]{1,64}$"});
    for (method, path) in operations(&doc) {
        for param in doc["paths"][&path][&method]["parameters"]
            .as_array()
            .into_iter()
            .flatten()
        {
            if param["in"] == "path"
                && ["queue", "task", "name"].contains(&param["name"].as_str().unwrap_or_default())
            {
                ensure!(param["schema"] == name, "{method} {path}: {param}");
                ensure!(param["required"] == true, "{method} {path}: {param}");
            }
        }
    }
    let task = &doc["components"]["schemas"]["SubmitRequest"]["properties"]["task"];
    ensure!(task == &name, "{task}");
    // And the server holds them to it: 65 characters, or a `:`, are refused.
    for queue in ["q".repeat(65), "a:b".to_owned()] {
        let (status, body) = call(&dtq, "get", &format!("/v1/queues/{queue}"), None).await?;
        ensure!(
            status == 400 && body["error"]["code"] == "INVALID_QUEUE_NAME",
            "{queue}: {status} {body}"
        );
    }
    let (status, body) = call(
        &dtq,
        "delete",
        &format!("/v1/queues/{QUEUE}/schedules/a:b"),
        None,
    )
    .await?;
    ensure!(
        status == 400 && body["error"]["code"] == "INVALID_SCHEDULE_NAME",
        "{status} {body}"
    );
    Ok(())
}
