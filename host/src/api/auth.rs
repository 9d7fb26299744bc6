//! Who may do what: API tokens with scopes, optionally limited to queues.
//!
//! A request shows its token as `Authorization: Bearer <token>`. Each token
//! grants some of four scopes:
//!
//! | scope | routes |
//! |---|---|
//! | `submit` | `POST /v1/queues/{queue}/tasks` |
//! | `read` | task status, queue counts, the DLQ listing |
//! | `cancel` | `POST /v1/queues/{queue}/tasks/{id}/cancel` |
//! | `admin` | DLQ requeue |
//!
//! Scopes do not imply each other: an operator's token lists every scope it
//! needs (or `*`). A token may be limited to some queues; a request for
//! another queue is refused (403) and the queue listing shows only its own.
//!
//! # Modes
//!
//! Without any scoped token configured ([`Tokens`] empty), the API is open
//! for development, as it was before tokens: anyone who reaches it may
//! submit, read and cancel, and the server warns about it at start. The admin
//! routes always need a token with the `admin` scope (`--admin-token` is one);
//! with none configured they are disabled (403 `ADMIN_DISABLED`), so a
//! deployment that never set one cannot be administered by anyone.
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
use serde_json::json;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use super::error::{ApiError, ErrorCode};
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
    /// Requeue dead-lettered tasks.
    Admin,
}

impl Scope {
    /// Every scope.
    pub const ALL: [Scope; 4] = [Scope::Submit, Scope::Read, Scope::Cancel, Scope::Admin];

    /// The scope's name in the token format and in errors.
    pub fn name(self) -> &'static str {
        match self {
            Scope::Submit => "submit",
            Scope::Read => "read",
            Scope::Cancel => "cancel",
            Scope::Admin => "admin",
        }
    }

    fn bit(self) -> u8 {
        1 << (self as u8)
    }

    fn parse(name: &str) -> Option<Scope> {
        Scope::ALL.into_iter().find(|s| s.name() == name)
    }
}

/// One configured token: its digest, its scopes and its queues.
#[derive(Clone)]
struct Grant {
    digest: [u8; 32],
    scopes: u8,
    /// `None`: every queue.
    queues: Option<Vec<String>>,
}

/// The scoped API tokens a server accepts. Empty: the API is open for
/// development (submit, read and cancel need no token; admin routes still
/// do).
///
/// # Format
///
/// One token per line (in `DTQ_TOKENS`, lines may also be separated by `;`):
///
/// ```text
/// # token                     scopes               queues (optional: all)
/// 3f6c0e1b9a...               submit,read          default,emails
/// sha256:9f86d081884c7d65...  read,cancel
/// ops-7d1e44c2...             *
/// ```
///
/// Fields are separated by spaces or tabs; blank lines and lines starting
/// with `#` are ignored. A token is visible ASCII other than `;`; scopes and
/// queues are comma-separated, `*` meaning all of them.
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

/// `token scopes [queues]`.
fn parse_entry(entry: &str) -> Result<Grant, String> {
    let fields: Vec<&str> = entry.split([' ', '\t']).filter(|f| !f.is_empty()).collect();
    let (token, scopes, queues) = match fields.as_slice() {
        [token, scopes] => (*token, *scopes, None),
        [token, scopes, queues] => (*token, *scopes, Some(*queues)),
        _ => {
            return Err(format!(
                "expected `token scopes [queues]`, found {} fields",
                fields.len()
            ));
        }
    };
    let digest = parse_token(token)?;
    let scopes = parse_scopes(scopes)?;
    let queues = match queues {
        Some(queues) => parse_queues(queues)?,
        None => None,
    };
    Ok(Grant {
        digest,
        scopes,
        queues,
    })
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
        return Ok(Scope::ALL.iter().fold(0, |acc, s| acc | s.bit()));
    }
    let mut scopes = 0;
    for name in field.split(',') {
        let scope = Scope::parse(name).ok_or_else(|| {
            format!("unknown scope {name:?}; the scopes are submit, read, cancel, admin and *")
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
    /// Some token has the admin scope.
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
            });
        }
        let admin_enabled = grants.iter().any(|g| g.scopes & Scope::Admin.bit() != 0);
        Auth {
            grants,
            open,
            admin_enabled,
        }
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
        if scope == Scope::Admin && !self.admin_enabled {
            return Err(ApiError::new(
                ErrorCode::AdminDisabled,
                "admin routes are disabled: no token has the admin scope \
                 (set DTQ_ADMIN_TOKEN, or give a token the admin scope)",
            ));
        }
        if scope != Scope::Admin && self.open {
            return Ok(Access::All);
        }
        let Some(presented) = bearer(headers) else {
            return Err(unauthorized(
                "this route needs `Authorization: Bearer <token>`",
            ));
        };
        let digest = digest_of(presented);
        // Every grant is compared, with no early exit; several grants of
        // one token add up.
        let mut known = false;
        let mut scoped: Option<Access> = None;
        for grant in &self.grants {
            if !bool::from(grant.digest.ct_eq(&digest)) {
                continue;
            }
            known = true;
            if grant.scopes & scope.bit() == 0 {
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
        if !known {
            return Err(unauthorized("the bearer token is not a configured token"));
        }
        let Some(access) = scoped else {
            return Err(ApiError::new(
                ErrorCode::Forbidden,
                format!("this token does not have the {} scope", scope.name()),
            )
            .with_details(json!({"scope": scope.name()})));
        };
        if let Some(queue) = queue
            && !access.allows(queue)
        {
            return Err(ApiError::new(
                ErrorCode::Forbidden,
                format!(
                    "this token's {} scope does not cover queue {queue:?}",
                    scope.name()
                ),
            )
            .with_details(json!({"scope": scope.name(), "queue": queue})));
        }
        Ok(access)
    }
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
