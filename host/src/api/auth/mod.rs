//! Who may do what: API tokens with scopes, limited to queues (the queue's
//! things) and to tasks, namespaces and hosts (the fleet's things).
//!
//! A request shows its token as `Authorization: Bearer <token>`. Each token
//! grants some of five scopes. Queue scopes (`submit`, `read`, `cancel`,
//! `admin`) are limited by the grant's queues; the fleet's objects
//! (handlers, namespaces, allow-lists, partitions, schedules' tasks) belong
//! to no queue, so a queue's grant never reaches them: they need a grant
//! that names them (`deploy`, with its `key=value` limits, see
//! `api::fleet`), or `admin` on every queue with no limits, the fleet's
//! operator (`--admin-token` is one).
//!
//! | route | needs | limited by |
//! |---|---|---|
//! | `POST /v1/queues/{q}/tasks`, `.../tasks/batch` | `submit` | queues |
//! | task, listing, lookup, events, queue counts, DLQ listing, schedules listing | `read` | queues |
//! | `GET /v1/handlers`, `GET /v1/handlers/{task}` | `read` | (any queue) |
//! | `GET /metrics` | `read` | every queue |
//! | `POST /v1/queues/{q}/tasks/{id}/cancel` | `cancel` | queues |
//! | DLQ requeue (one, many), DLQ purge | `admin` | queues |
//! | `PUT`, `DELETE /v1/queues/{q}/schedules/{name}` | `admin` on `q`, and a grant covering the schedule's task | queues; `tasks=` of an `admin` or `deploy` grant (an unlimited `deploy` grant covers every task) |
//! | `PUT /v1/queues/{q}/partitions` | `admin` on every queue | — |
//! | `PUT /v1/handlers/{task}` (deploy) | `deploy`, or the operator | `tasks=`, `namespaces=`, `hosts=`, `kv_quota_mib=`, all within one grant |
//! | `POST /v1/handlers/{task}/rollback` | `deploy`, or the operator | as a deploy of the version it restores (module and settings) |
//! | `DELETE /v1/handlers/{task}` (undeploy) | `deploy`, or the operator | `tasks=` |
//!
//! A queue-scoped `admin` on a fleet route is refused with 403 `FORBIDDEN`,
//! the message and `details.scope` naming what it lacks (`details.task`,
//! `namespace`, `host` or `kv_quota_mib` too when a deploy grant does not
//! cover one of them). Scopes do not imply each other: a token lists every
//! scope it needs (`*` is the four queue scopes; `deploy` is named, never
//! implied).
//!
//! # Modes
//!
//! Without any scoped token configured ([`Tokens`] empty), the API is open
//! for development, as it was before tokens: anyone who reaches it may
//! submit, read and cancel, and the server warns about it at start. The
//! admin and fleet routes always need a token (`--admin-token` is one);
//! with no token having the `admin` or the `deploy` scope they are disabled
//! (403 `ADMIN_DISABLED`), so a deployment that never set one cannot be
//! administered by anyone.
//!
//! # Comparison
//!
//! Tokens are kept as SHA-256 digests, and a presented token is hashed and
//! compared with every configured digest in constant time ([`subtle`]), with
//! no early exit: neither how many leading bytes of a guess were right, nor
//! the configured token's length, shows in the time taken. The file may hold
//! the digests themselves (`sha256:<hex>`), so it need not hold a secret.
//!
//! The token format is on [`Tokens`].

mod tokens;

use axum::http::{HeaderMap, header};
use serde_json::{Value, json};
use subtle::ConstantTimeEq;

use super::error::ApiError;
use super::fleet::{Limits, Uncovered};
use super::openapi::TokenMode;
use crate::base::ErrorCode;
use crate::deploy::DeploySettings;
use tokens::{Grant, digest_of};
pub use tokens::{Scope, Tokens, TokensError};

/// What a request may reach once authorized.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Access {
    /// Every queue.
    All,
    /// Only these queues.
    Queues(Vec<String>),
}

impl Access {
    /// Whether `queue` is among the reachable ones.
    pub(super) fn allows(&self, queue: &str) -> bool {
        match self {
            Access::All => true,
            Access::Queues(qs) => qs.iter().any(|q| q == queue),
        }
    }
}

/// The tokens a running API checks requests against.
pub(super) struct Auth {
    grants: Vec<Grant>,
    /// No scoped token is configured: submit, read and cancel are open.
    open: bool,
    /// Some token has the admin or the deploy scope.
    admin_enabled: bool,
}

impl Auth {
    /// The scoped `tokens`, plus `admin_token` (`--admin-token`) with the
    /// admin scope on every queue.
    pub(super) fn new(tokens: &Tokens, admin_token: Option<&str>) -> Auth {
        let open = tokens.is_empty();
        let mut grants = tokens.grants.clone();
        if let Some(token) = admin_token.filter(|t| !t.is_empty()) {
            grants.push(Grant {
                digest: digest_of(token.as_bytes()),
                scopes: Scope::Admin.bit(),
                queues: None,
                limits: Limits::default(),
            });
        }
        let admin_enabled = grants
            .iter()
            .any(|g| g.has(Scope::Admin) || g.has(Scope::Deploy));
        Auth {
            grants,
            open,
            admin_enabled,
        }
    }

    /// Who must show a token, for the document the API serves.
    pub(super) fn token_mode(&self) -> TokenMode {
        match (self.open, self.admin_enabled) {
            (false, _) => TokenMode::Scoped,
            (true, true) => TokenMode::AdminOnly,
            (true, false) => TokenMode::Open,
        }
    }

    /// The grants of the request's token (401 `UNAUTHORIZED` when it shows
    /// none, or one that is not configured).
    fn grants_of(&self, headers: &HeaderMap) -> Result<Vec<&Grant>, ApiError> {
        let Some(presented) = bearer(headers) else {
            return Err(unauthorized(
                "this route needs `Authorization: Bearer <token>`",
            ));
        };
        let digest = digest_of(presented);
        // Every grant is compared, with no early exit; several grants of
        // one token add up.
        let mut matched = Vec::new();
        for grant in &self.grants {
            if bool::from(grant.digest.ct_eq(&digest)) {
                matched.push(grant);
            }
        }
        if matched.is_empty() {
            return Err(unauthorized("the bearer token is not a configured token"));
        }
        Ok(matched)
    }

    fn check_enabled(&self) -> Result<(), ApiError> {
        if self.admin_enabled {
            return Ok(());
        }
        Err(ApiError::new(
            ErrorCode::AdminDisabled,
            "admin routes are disabled: no token has the admin or the deploy scope \
             (set DTQ_ADMIN_TOKEN, or give a token one of them)",
        ))
    }

    /// Check that the request's token grants `scope`, on `queue` when the
    /// route names one. Returns the queues the request may reach with that
    /// scope.
    ///
    /// 401 `UNAUTHORIZED`: no token, or one that is not configured; 403
    /// `FORBIDDEN`: a token without the scope or the queue; 403
    /// `ADMIN_DISABLED`: an admin route where no token has the admin scope.
    pub(super) fn authorize(
        &self,
        headers: &HeaderMap,
        scope: Scope,
        queue: Option<&str>,
    ) -> Result<Access, ApiError> {
        if scope == Scope::Admin {
            self.check_enabled()?;
        }
        if scope != Scope::Admin && self.open {
            return Ok(Access::All);
        }
        let mut scoped: Option<Access> = None;
        for grant in self.grants_of(headers)? {
            if !grant.has(scope) {
                continue;
            }
            scoped = Some(match (scoped, &grant.queues) {
                (Some(Access::All), _) | (_, None) => Access::All,
                (Some(Access::Queues(mut qs)), Some(more)) => {
                    qs.extend(more.iter().cloned());
                    Access::Queues(qs)
                }
                (None, Some(qs)) => Access::Queues(qs.clone()),
            });
        }
        let Some(access) = scoped else {
            return Err(forbidden(
                format!("this token does not have the {} scope", scope.name()),
                json!({"scope": scope.name()}),
            ));
        };
        if let Some(queue) = queue
            && !access.allows(queue)
        {
            return Err(forbidden(
                format!(
                    "this token's {} scope does not cover queue {queue:?}",
                    scope.name()
                ),
                json!({"scope": scope.name(), "queue": queue}),
            ));
        }
        Ok(access)
    }

    /// Check that the request's token has `admin` on every queue, as a
    /// fleet-wide change of `queue` (a partition raise) needs: 403
    /// `FORBIDDEN` for one whose admin covers only some queues.
    pub(super) fn authorize_every_queue(
        &self,
        headers: &HeaderMap,
        queue: &str,
    ) -> Result<(), ApiError> {
        match self.authorize(headers, Scope::Admin, Some(queue))? {
            Access::All => Ok(()),
            Access::Queues(_) => Err(forbidden(
                "this route changes the fleet, which needs the admin scope on every \
                 queue (`*`); this token's admin covers only its queues"
                    .into(),
                json!({"scope": "admin", "queues": "*"}),
            )),
        }
    }

    /// Check that the request's token may set or delete a schedule of
    /// `task` on `queue`: `admin` on the queue, and a grant that covers the
    /// task (the operator's, a deploy grant covering it, or an admin grant
    /// whose `tasks=` names it). A schedule submits its task unattended, so
    /// a queue's admin may schedule only tasks it was granted.
    pub(super) fn authorize_schedule(
        &self,
        headers: &HeaderMap,
        queue: &str,
        task: &str,
    ) -> Result<(), ApiError> {
        self.authorize(headers, Scope::Admin, Some(queue))?;
        if self
            .grants_of(headers)?
            .iter()
            .any(|g| g.covers_schedule_task(task))
        {
            return Ok(());
        }
        Err(forbidden(
            format!(
                "this token's grants do not cover task {task:?}: a schedule needs the admin \
                 scope on its queue and a grant naming its task (`tasks=`), or admin on \
                 every queue"
            ),
            json!({"scope": "admin", "task": task}),
        ))
    }

    /// The fleet powers of the request's token: 401 as [`Auth::authorize`],
    /// 403 `FORBIDDEN` for a token with neither a deploy grant nor admin on
    /// every queue (a queue's admin included), 403 `ADMIN_DISABLED` when no
    /// token has either scope.
    pub(super) fn fleet(&self, headers: &HeaderMap) -> Result<Fleet<'_>, ApiError> {
        self.check_enabled()?;
        let grants = self.grants_of(headers)?;
        let operator = grants.iter().any(|g| g.is_operator());
        let deploy: Vec<&Limits> = grants
            .iter()
            .filter(|g| g.has(Scope::Deploy))
            .map(|g| &g.limits)
            .collect();
        if !operator && deploy.is_empty() {
            return Err(forbidden(
                "this token does not have the deploy scope: handlers are the fleet's, \
                 so changing them needs a deploy grant or the admin scope on every queue \
                 (`*`); an admin scope on some queues does not cover them"
                    .into(),
                json!({"scope": "deploy"}),
            ));
        }
        Ok(Fleet { operator, deploy })
    }
}

/// What a token may do to the fleet's handlers ([`Auth::fleet`]).
pub(super) struct Fleet<'a> {
    /// `admin` on every queue: everything.
    operator: bool,
    /// The limits of each deploy grant.
    deploy: Vec<&'a Limits>,
}

impl Fleet<'_> {
    /// Whether the token is the fleet's operator (no limit applies).
    pub(super) fn is_operator(&self) -> bool {
        self.operator
    }

    /// Check that `task` is the token's to roll back or undeploy.
    pub(super) fn may_touch(&self, task: &str) -> Result<(), ApiError> {
        if self.operator || self.deploy.iter().any(|l| l.covers_task(task)) {
            return Ok(());
        }
        Err(forbidden(
            format!("no deploy grant of this token covers task {task:?}"),
            json!({"scope": "deploy", "task": task}),
        ))
    }

    /// Check that a version of `task` with `settings` is the token's to
    /// make active: one deploy grant must cover task, namespace, hosts and
    /// quota together (two grants do not add up to a third). The refusal
    /// names what the first grant covering the task lacks.
    pub(super) fn may_activate(
        &self,
        task: &str,
        settings: &DeploySettings,
    ) -> Result<(), ApiError> {
        if self.operator {
            return Ok(());
        }
        let mut first = None;
        for limits in self.deploy.iter().filter(|l| l.covers_task(task)) {
            match limits.refuse_version(task, settings) {
                None => return Ok(()),
                Some(refusal) => {
                    first.get_or_insert(refusal);
                }
            }
        }
        let refusal = first.unwrap_or_else(|| Uncovered {
            message: format!("no deploy grant of this token covers task {task:?}"),
            details: json!({"scope": "deploy", "task": task}),
        });
        Err(forbidden(refusal.message, refusal.details))
    }
}

fn forbidden(message: String, details: Value) -> ApiError {
    ApiError::new(ErrorCode::Forbidden, message).with_details(details)
}

/// The token of `Authorization: Bearer <token>` (the scheme is
/// case-insensitive, RFC 9110 §11.1).
fn bearer(headers: &HeaderMap) -> Option<&[u8]> {
    let value = headers.get(header::AUTHORIZATION)?.as_bytes();
    let (scheme, token) = value.split_at_checked(7)?;
    if !scheme.eq_ignore_ascii_case(b"bearer ") {
        return None;
    }
    let token = token.trim_ascii();
    (!token.is_empty()).then_some(token)
}

fn unauthorized(message: &str) -> ApiError {
    ApiError::new(ErrorCode::Unauthorized, message)
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn headers(token: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        if let Ok(v) = HeaderValue::from_str(&format!("Bearer {token}")) {
            h.insert(header::AUTHORIZATION, v);
        }
        h
    }

    fn code(r: Result<Access, ApiError>) -> &'static str {
        match r {
            Ok(_) => "OK",
            Err(e) => e.code.as_str(),
        }
    }

    #[test]
    fn the_format_parses_scopes_queues_digests_and_comments() -> Result<(), TokensError> {
        let hashed = Tokens::hashed("hashed-token");
        let text =
            format!("# comment\n\n  alpha submit,read default,emails\n{hashed}\tcancel\nops * *\n");
        let tokens = Tokens::parse(text.split('\n'), "test")?;
        assert_eq!(tokens.len(), 3);
        let auth = Auth::new(&tokens, None);
        assert_eq!(
            code(auth.authorize(&headers("alpha"), Scope::Read, Some("emails"))),
            "OK"
        );
        assert_eq!(
            code(auth.authorize(&headers("alpha"), Scope::Read, Some("other"))),
            "FORBIDDEN"
        );
        assert_eq!(
            code(auth.authorize(&headers("alpha"), Scope::Cancel, Some("default"))),
            "FORBIDDEN"
        );
        assert_eq!(
            code(auth.authorize(&headers("hashed-token"), Scope::Cancel, Some("x"))),
            "OK"
        );
        assert_eq!(
            code(auth.authorize(&headers("ops"), Scope::Admin, Some("x"))),
            "OK"
        );
        assert_eq!(
            code(auth.authorize(&headers("nope"), Scope::Read, None)),
            "UNAUTHORIZED"
        );
        assert_eq!(
            code(auth.authorize(&HeaderMap::new(), Scope::Read, None)),
            "UNAUTHORIZED"
        );
        Ok(())
    }

    #[test]
    fn open_mode_lets_everything_but_admin_through() {
        let auth = Auth::new(&Tokens::default(), None);
        assert_eq!(
            code(auth.authorize(&HeaderMap::new(), Scope::Cancel, Some("q"))),
            "OK"
        );
        assert_eq!(
            code(auth.authorize(&headers("x"), Scope::Admin, None)),
            "ADMIN_DISABLED"
        );
        let auth = Auth::new(&Tokens::default(), Some("s3cret"));
        assert_eq!(
            code(auth.authorize(&headers("s3cret"), Scope::Admin, Some("q"))),
            "OK"
        );
        assert_eq!(
            code(auth.authorize(&headers("s3cre"), Scope::Admin, None)),
            "UNAUTHORIZED"
        );
    }

    #[test]
    fn grants_of_one_token_add_up() -> Result<(), TokensError> {
        let tokens = Tokens::parse_variable("t read a; t read b; t submit", "DTQ_TOKENS")?;
        let auth = Auth::new(&tokens, None);
        assert_eq!(
            auth.authorize(&headers("t"), Scope::Read, None).ok(),
            Some(Access::Queues(vec!["a".into(), "b".into()]))
        );
        assert_eq!(
            auth.authorize(&headers("t"), Scope::Submit, Some("z")).ok(),
            Some(Access::All)
        );
        Ok(())
    }

    fn refused<T>(r: Result<T, ApiError>) -> (String, Value) {
        match r {
            Ok(_) => ("OK".into(), Value::Null),
            Err(e) => (e.code.as_str().into(), e.details),
        }
    }

    const FLEET_TOKENS: &str = "qadmin admin,read emails;\
         mail admin emails tasks=send_*;\
         dep deploy tasks=send_* namespaces=mail hosts=https://*.mailer.example kv_quota_mib=8;\
         anydep deploy;\
         ops *";

    #[test]
    fn a_queues_admin_has_no_fleet_power() -> Result<(), TokensError> {
        let auth = Auth::new(&Tokens::parse_variable(FLEET_TOKENS, "t")?, None);
        let (refusal, details) = refused(auth.fleet(&headers("qadmin")));
        assert_eq!(
            (refusal.as_str(), &details["scope"]),
            ("FORBIDDEN", &json!("deploy"))
        );
        let (refusal, details) = refused(auth.authorize_every_queue(&headers("qadmin"), "emails"));
        assert_eq!(
            (refusal.as_str(), &details["scope"]),
            ("FORBIDDEN", &json!("admin"))
        );
        let (refusal, details) =
            refused(auth.authorize_schedule(&headers("qadmin"), "emails", "send_mail"));
        assert_eq!(
            (refusal.as_str(), &details["task"]),
            ("FORBIDDEN", &json!("send_mail"))
        );
        // Its queue's own powers are untouched.
        assert_eq!(
            code(auth.authorize(&headers("qadmin"), Scope::Admin, Some("emails"))),
            "OK"
        );
        // The operator has all of them.
        assert!(auth.fleet(&headers("ops")).is_ok_and(|f| f.is_operator()));
        assert_eq!(
            refused(auth.authorize_every_queue(&headers("ops"), "x")).0,
            "OK"
        );
        assert_eq!(
            refused(auth.authorize_schedule(&headers("ops"), "x", "any")).0,
            "OK"
        );
        Ok(())
    }

    #[test]
    fn schedules_need_the_queue_and_a_grant_naming_the_task() -> Result<(), TokensError> {
        let auth = Auth::new(&Tokens::parse_variable(FLEET_TOKENS, "t")?, None);
        let schedule =
            |token, queue, task| refused(auth.authorize_schedule(&headers(token), queue, task)).0;
        assert_eq!(schedule("mail", "emails", "send_mail"), "OK");
        assert_eq!(schedule("mail", "emails", "report"), "FORBIDDEN");
        assert_eq!(schedule("mail", "other", "send_mail"), "FORBIDDEN");
        // A deploy grant alone has no queue to schedule on.
        assert_eq!(schedule("dep", "emails", "send_mail"), "FORBIDDEN");
        Ok(())
    }

    #[test]
    fn a_deploy_grant_covers_its_tasks_namespaces_hosts_and_quota() -> Result<(), TokensError> {
        let auth = Auth::new(&Tokens::parse_variable(FLEET_TOKENS, "t")?, None);
        let fleet = auth.fleet(&headers("dep")).expect("a deploy grant");
        assert!(!fleet.is_operator());
        let with = |ns: &str, hosts: Option<&str>, quota| DeploySettings {
            namespace: Some(ns.into()),
            allow_hosts: hosts.map(str::to_owned),
            kv_quota_mib: quota,
            ..DeploySettings::default()
        };
        assert_eq!(
            refused(fleet.may_activate(
                "send_a",
                &with("mail", Some("https://api.mailer.example"), Some(8))
            ))
            .0,
            "OK"
        );
        let refusal =
            |task, settings: &DeploySettings| refused(fleet.may_activate(task, settings)).1;
        assert_eq!(
            refusal("report", &with("mail", None, None))["task"],
            "report"
        );
        assert_eq!(
            refusal("send_a", &with("billing", None, None))["namespace"],
            "billing"
        );
        assert_eq!(
            refusal("send_a", &with("mail", Some("http://10.0.0.1:*"), None))["host"],
            "http://10.0.0.1:*"
        );
        assert_eq!(
            refusal("send_a", &with("mail", None, Some(0)))["kv_quota_mib"],
            0
        );
        assert_eq!(refused(fleet.may_touch("send_a")).0, "OK");
        assert_eq!(refused(fleet.may_touch("report")).0, "FORBIDDEN");
        // An unlimited deploy grant: every task, each in its own namespace.
        let any = auth.fleet(&headers("anydep")).expect("a deploy grant");
        assert_eq!(
            refused(any.may_activate("report", &with("report", None, None))).0,
            "OK"
        );
        assert_eq!(
            refusal_of(&any, "report", &with("billing", None, None))["namespace"],
            "billing"
        );
        Ok(())
    }

    fn refusal_of(fleet: &Fleet<'_>, task: &str, settings: &DeploySettings) -> Value {
        refused(fleet.may_activate(task, settings)).1
    }

    #[test]
    fn the_bearer_scheme_is_case_insensitive() {
        let mut h = HeaderMap::new();
        h.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("bEaReR  tok "),
        );
        assert_eq!(bearer(&h), Some(&b"tok"[..]));
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Basic tok"));
        assert_eq!(bearer(&h), None);
    }
}
