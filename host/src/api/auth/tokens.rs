//! The token format: tokens, their scopes, queues and fleet limits, as
//! the tokens file and `DTQ_TOKENS` give them, parsed into grants.

use std::path::Path;

use sha2::{Digest, Sha256};

use crate::api::fleet::Limits;
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

    pub(super) fn bit(self) -> u8 {
        1 << (self as u8)
    }

    fn parse(name: &str) -> Option<Scope> {
        Scope::ALL.into_iter().find(|s| s.name() == name)
    }
}

/// One configured token: its digest, its scopes, its queues and its fleet
/// limits.
#[derive(Clone)]
pub(super) struct Grant {
    pub(super) digest: [u8; 32],
    pub(super) scopes: u8,
    /// `None`: every queue.
    pub(super) queues: Option<Vec<String>>,
    /// The `key=value` fields.
    pub(super) limits: Limits,
}

impl Grant {
    pub(super) fn has(&self, scope: Scope) -> bool {
        self.scopes & scope.bit() != 0
    }

    /// `admin` on every queue, unlimited: the fleet's operator.
    pub(super) fn is_operator(&self) -> bool {
        self.has(Scope::Admin) && self.queues.is_none() && !self.limits.any()
    }

    /// Whether a schedule of `task` is this grant's to set: the operator's,
    /// a deploy grant's that covers the task, or an admin grant's whose
    /// `tasks=` names it.
    pub(super) fn covers_schedule_task(&self, task: &str) -> bool {
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
    pub(super) grants: Vec<Grant>,
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

    pub(super) fn parse<'a>(
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

/// The SHA-256 digest of `token`, as grants keep it.
pub(super) fn digest_of(token: &[u8]) -> [u8; 32] {
    Sha256::digest(token).into()
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
