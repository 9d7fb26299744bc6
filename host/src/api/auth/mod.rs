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

use std::path::Path;

use axum::http::{HeaderMap, header};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use super::error::ApiError;
use crate::base::ErrorCode;
use super::fleet::{Limits, Uncovered};
use crate::deploy::DeploySettings;
use crate::ingest::validate_queue_name;

/// A permission a token grants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// Submit tasks.
    Submit,
    /// Read tasks, queue counts and the DLQ.
    Read,
    /// Cancel tasks.
    Cancel,
    /// A queue's operator powers: DLQ requeue and purge, schedules (of the
    /// tasks the token is granted). On every queue and with no fields, the
    /// fleet's operator: every power.
    Admin,
    /// Deploy, roll back and undeploy handlers, within the grant's
    /// `tasks=`, `namespaces=`, `hosts=` and `kv_quota_mib=` (`api::fleet`).
    Deploy,
}

impl Scope {
    /// Every scope.
    pub const ALL: [Scope; 5] = [
        Scope::Submit,
        Scope::Read,
        Scope::Cancel,
        Scope::Admin,
        Scope::Deploy,
    ];

    /// The scopes of a queue, which `*` stands for. `deploy` is not among
    /// them: a fleet power is named, never implied.
    pub const QUEUE: [Scope; 4] = [Scope::Submit, Scope::Read, Scope::Cancel, Scope::Admin];

    /// The scope's name in the token format and in errors.
    pub fn name(self) -> &'static str {
        match self {
            Scope::Submit => "submit",
            Scope::Read => "read",
            Scope::Cancel => "cancel",
            Scope::Admin => "admin",
            Scope::Deploy => "deploy",
        }
    }

    fn bit(self) -> u8 {
        1 << (self as u8)
    }

    fn parse(name: &str) -> Option<Scope> {
        Scope::ALL.into_iter().find(|s| s.name() == name)
    }
}

/// One configured token: its digest, its scopes, its queues and its fleet
/// limits.
#[derive(Clone)]
struct Grant {
    digest: [u8; 32],
    scopes: u8,
    /// `None`: every queue.
    queues: Option<Vec<String>>,
    /// The `key=value` fields.
    limits: Limits,
}

impl Grant {
    fn has(&self, scope: Scope) -> bool {
        self.scopes & scope.bit() != 0
    }

    /// `admin` on every queue, unlimited: the fleet's operator.
    fn is_operator(&self) -> bool {
        self.has(Scope::Admin) && self.queues.is_none() && !self.limits.any()
    }

    /// Whether a schedule of `task` is this grant's to set: the operator's,
    /// a deploy grant's that covers the task, or an admin grant's whose
    /// `tasks=` names it.
    fn covers_schedule_task(&self, task: &str) -> bool {
        self.is_operator()
            || (self.has(Scope::Deploy) && self.limits.covers_task(task))
            || (self.has(Scope::Admin)
                && self.limits.tasks.as_ref().is_some_and(|t| t.matches(task)))
    }
}

/// The scoped API tokens a server accepts. Empty: the API is open for
/// development (submit, read and cancel need no token; admin and fleet
/// routes still do).
///
/// # Format
///
/// One token per line (in `DTQ_TOKENS`, lines may also be separated by `;`):
/// `token scopes [queues] [key=value ...]`.
///
/// ```text
/// # token                     scopes          queues (optional: all)  limits (optional)
/// 3f6c0e1b9a...               submit,read     default,emails
/// sha256:9f86d081884c7d65...  read,cancel
/// mail-team-5c0e...           admin           emails                  tasks=send_*
/// mail-deploy-8a1f...         deploy                                  tasks=send_* namespaces=mail hosts=https://*.mailer.example kv_quota_mib=64
/// ops-7d1e44c2...             *
/// ```
///
/// Fields are separated by spaces or tabs; blank lines and lines starting
/// with `#` are ignored. A token is visible ASCII other than `;`; scopes and
/// queues are comma-separated, `*` meaning all of them (for scopes: the four
/// queue scopes, not `deploy`). The queues field is the third one when it
/// has no `=`.
///
/// The `key=value` fields limit fleet powers:
///
/// | field | value | absent |
/// |---|---|---|
/// | `tasks=` | names, prefixes ending in `*`, comma-separated (`a,b-*`), or `*`: the tasks a `deploy` grant may deploy, roll back and undeploy, and an `admin` or `deploy` grant may schedule | a `deploy` grant: every task; an `admin` grant: none to schedule |
/// | `namespaces=` | names or prefixes, or `*`: the namespaces a deploy may give | only each task's own (its name, the default) |
/// | `hosts=` | `scheme://host[:port]` patterns, as `allow_hosts` takes them, or `*`: each pattern of a deploy's `allow_hosts` must fall within one | no `allow_hosts` |
/// | `kv_quota_mib=` | N ≥ 1: a deploy may give `kv_quota_mib` 1 to N (never 0, no budget) | no `kv_quota_mib` (the workers' `--kv-quota-mib` applies) |
///
/// `tasks=` goes on a grant with `admin` (on listed queues) or `deploy`; the
/// others on one with `deploy`. A grant with `admin` on every queue takes
/// none: it has every power already. Several grants of one token add up
/// for queues, but a deploy is checked against one grant at a time (a task
/// of one grant does not get the namespace of another).
#[derive(Clone, Default)]
pub struct Tokens {
    grants: Vec<Grant>,
}

impl std::fmt::Debug for Tokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the digests.
        write!(f, "Tokens({} configured)", self.grants.len())
    }
}

/// A token file or variable that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TokensError {
    /// The file cannot be read.
    #[error("cannot read the tokens file {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// An entry is not `token scopes [queues]`.
    #[error("{origin}, entry {entry}: {message}")]
    Entry {
        /// Where the entry is (`the tokens file /etc/dtq/tokens`, `DTQ_TOKENS`).
        origin: String,
        /// Its number, from 1 (the line number in a file).
        entry: usize,
        /// What is wrong.
        message: String,
    },
}

impl Tokens {
    /// Read the token file at `path` (format in the module documentation).
    pub fn load(path: &Path) -> Result<Tokens, TokensError> {
        let text = std::fs::read_to_string(path).map_err(|source| TokensError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Tokens::parse(
            text.split('\n'),
            &format!("the tokens file {}", path.display()),
        )
    }

    /// Parse the tokens of a variable such as `DTQ_TOKENS`: entries separated
    /// by newlines or `;`.
    pub fn parse_variable(text: &str, name: &str) -> Result<Tokens, TokensError> {
        Tokens::parse(text.split(['\n', ';']), name)
    }

    fn parse<'a>(
        entries: impl Iterator<Item = &'a str>,
        origin: &str,
    ) -> Result<Tokens, TokensError> {
        let mut tokens = Tokens::default();
        for (n, entry) in entries.enumerate() {
            let entry = entry.trim();
            if entry.is_empty() || entry.starts_with('#') {
                continue;
            }
            let grant = parse_entry(entry).map_err(|message| TokensError::Entry {
                origin: origin.to_owned(),
                entry: n + 1,
                message,
            })?;
            tokens.grants.push(grant);
        }
        Ok(tokens)
    }

    /// Add `token` with `scopes`, limited to `queues` (`None`: all).
    pub fn add(
        &mut self,
        token: &str,
        scopes: &[Scope],
        queues: Option<&[&str]>,
    ) -> Result<(), TokensError> {
        let fail = |message| TokensError::Entry {
            origin: "a token added by the program".into(),
            entry: 1,
            message,
        };
        let digest = parse_token(token).map_err(fail)?;
        let queues = match queues {
            None => None,
            Some(qs) => parse_queues(&qs.join(",")).map_err(fail)?,
        };
        self.grants.push(Grant {
            digest,
            scopes: scopes.iter().fold(0, |acc, s| acc | s.bit()),
            queues,
            limits: Limits::default(),
        });
        Ok(())
    }

    /// The form of `token` to write in a tokens file instead of the token
    /// itself: `sha256:<hex digest>`.
    pub fn hashed(token: &str) -> String {
        format!("sha256:{}", hex::encode(digest_of(token.as_bytes())))
    }

    /// Every token of `other` too.
    pub fn extend(&mut self, other: Tokens) {
        self.grants.extend(other.grants);
    }

    /// How many tokens are configured.
    pub fn len(&self) -> usize {
        self.grants.len()
    }

    /// Whether none is (the API is open).
    pub fn is_empty(&self) -> bool {
        self.grants.is_empty()
    }
}

/// `token scopes [queues] [key=value ...]`.
fn parse_entry(entry: &str) -> Result<Grant, String> {
    let mut fields = entry
        .split([' ', '\t'])
        .filter(|f| !f.is_empty())
        .peekable();
    let (Some(token), Some(scopes)) = (fields.next(), fields.next()) else {
        return Err("expected `token scopes [queues] [key=value ...]`".into());
    };
    let digest = parse_token(token)?;
    let scopes = parse_scopes(scopes)?;
    let queues = match fields.next_if(|f| !f.contains('=')) {
        Some(queues) => parse_queues(queues)?,
        None => None,
    };
    let mut limits = Limits::default();
    for field in fields {
        limits.parse_field(field)?;
    }
    let grant = Grant {
        digest,
        scopes,
        queues,
        limits,
    };
    check_grant(&grant)?;
    Ok(grant)
}

/// Refuse a grant whose fields would not mean what they seem to.
fn check_grant(grant: &Grant) -> Result<(), String> {
    let (admin, deploy) = (grant.has(Scope::Admin), grant.has(Scope::Deploy));
    if grant.limits.any() && admin && grant.queues.is_none() {
        return Err(
            "admin on every queue has every fleet power, which `key=value` fields \
                    would not limit; limit a deploy grant on a line of its own"
                .into(),
        );
    }
    if grant.limits.any() && !deploy && !(admin && grant.limits.tasks_only()) {
        return Err(
            "`tasks=` limits the admin and deploy scopes; `namespaces=`, `hosts=` \
                    and `kv_quota_mib=` the deploy scope"
                .into(),
        );
    }
    if grant.scopes == Scope::Deploy.bit() && grant.queues.is_some() {
        return Err("the deploy scope is not limited by queues (use `tasks=`)".into());
    }
    Ok(())
}

/// A token's digest: `sha256:<64 hex>` as given, anything else hashed.
fn parse_token(token: &str) -> Result<[u8; 32], String> {
    if token.is_empty() || !token.bytes().all(|b| b.is_ascii_graphic() && b != b';') {
        return Err("a token must be visible ASCII characters other than `;`".into());
    }
    if let Some(hex_digest) = token.strip_prefix("sha256:") {
        let mut digest = [0u8; 32];
        hex::decode_to_slice(hex_digest, &mut digest)
            .map_err(|e| format!("`sha256:` must be followed by 64 hex digits: {e}"))?;
        return Ok(digest);
    }
    Ok(digest_of(token.as_bytes()))
}

fn parse_scopes(field: &str) -> Result<u8, String> {
    if field == "*" {
        return Ok(Scope::QUEUE.iter().fold(0, |acc, s| acc | s.bit()));
    }
    let mut scopes = 0;
    for name in field.split(',') {
        let scope = Scope::parse(name).ok_or_else(|| {
            format!(
                "unknown scope {name:?}; the scopes are submit, read, cancel, admin, deploy and *"
            )
        })?;
        scopes |= scope.bit();
    }
    Ok(scopes)
}

/// `None`: every queue (`*`).
fn parse_queues(field: &str) -> Result<Option<Vec<String>>, String> {
    if field == "*" {
        return Ok(None);
    }
    field
        .split(',')
        .map(|q| {
            validate_queue_name(q)
                .map(|()| q.to_owned())
                .map_err(|e| e.to_string())
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}

fn digest_of(token: &[u8]) -> [u8; 32] {
    Sha256::digest(token).into()
}

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
    fn bad_entries_name_their_line() {
        for (text, line) in [
            ("ok read\nbad\n", 2),
            ("t reed", 1),
            ("\n\nt read a:b", 3),
            ("sha256:abc read", 1),
            ("t read q extra", 1),
            ("t read q a=b", 1),
        ] {
            match Tokens::parse(text.split('\n'), "f") {
                Err(TokensError::Entry { entry, .. }) => assert_eq!(entry, line, "{text:?}"),
                other => panic!("{text:?}: {other:?}"),
            }
        }
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
    fn fields_that_would_mislead_are_refused() {
        for text in [
            "t admin tasks=a",
            "t * * tasks=a",
            "t admin q namespaces=a",
            "t submit q tasks=a",
            "t deploy q",
            "t deploy tasks=a tasks=b",
            "t deploy q tasks=a extra",
        ] {
            assert!(
                matches!(
                    Tokens::parse_variable(text, "t"),
                    Err(TokensError::Entry { entry: 1, .. })
                ),
                "{text}"
            );
        }
        for text in [
            "t admin q tasks=a",
            "t deploy",
            "t deploy *",
            "t submit,deploy q tasks=a hosts=*",
        ] {
            assert!(Tokens::parse_variable(text, "t").is_ok(), "{text}");
        }
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
