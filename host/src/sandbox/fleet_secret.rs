//! The fleet's secret, and the downstream `Idempotency-Key`s made with it.
//!
//! A request a handler sends inside an idempotent operation carries an
//! `Idempotency-Key` the host derives from the handler's namespace and the
//! operation's key, so that a service that honours the header applies the
//! effect once however often the operation runs. Were the key a plain
//! digest of those two, any handler could compute another namespace's keys
//! and send one first to a service both use: the service would then answer
//! the other's request with the first one's stored answer, and its own
//! effect would never happen. So the key is an HMAC-SHA256 under a secret
//! no handler can read:
//!
//! - the operator's, from `--fleet-secret-file` (every process of the fleet
//!   must be given the same file, or their keys differ); else
//! - the fleet's own, made once in Redis: the first process to need it
//!   writes 32 random bytes under [`FLEET_SECRET_KEY`] (`SET NX`), and
//!   every process reads it from there. No kv key of a handler can name it
//!   (they all live under `dtq:guest:{<namespace>}:`).
//!
//! A handler may send a key of its own, but not one that starts with the
//! host's [`HOST_KEY_PREFIX`] (refused, see `http.rs`), so no key a handler
//! sends can equal one the host derived for another namespace.

use std::path::Path;

use hmac::{Hmac, Mac as _};
use sha2::Sha256;
use tokio::sync::OnceCell;

use super::SandboxError;
use crate::store::Conn;

/// Where the fleet's own secret lives in Redis.
pub const FLEET_SECRET_KEY: &str = "dtq:fleet-secret";

/// What every host-derived `Idempotency-Key` starts with; a handler's own
/// key may not.
pub const HOST_KEY_PREFIX: &str = "dtq-";

/// Fewest bytes an operator's secret may have.
const MIN_SECRET_BYTES: usize = 32;

/// The secret, once known: the operator's, or read from Redis on first use.
pub(crate) struct FleetSecret {
    secret: OnceCell<Vec<u8>>,
}

impl std::fmt::Debug for FleetSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FleetSecret(..)")
    }
}

impl FleetSecret {
    /// The operator's secret in `file` (its bytes, trailing whitespace
    /// trimmed, at least 32), or, without a file, the fleet's own in Redis.
    pub(crate) fn new(file: Option<&Path>) -> Result<FleetSecret, SandboxError> {
        let secret = OnceCell::new();
        if let Some(path) = file {
            let mut bytes = std::fs::read(path).map_err(|source| SandboxError::Io {
                path: path.to_path_buf(),
                source,
            })?;
            bytes.truncate(bytes.trim_ascii_end().len());
            if bytes.len() < MIN_SECRET_BYTES {
                return Err(SandboxError::FleetSecret {
                    path: path.to_path_buf(),
                    len: bytes.len(),
                });
            }
            // A fresh cell takes its first value.
            let _ = secret.set(bytes);
        }
        Ok(FleetSecret { secret })
    }

    /// The secret: the operator's, or the fleet's own, made in Redis by the
    /// first process that needs it.
    async fn get(&self, redis: &mut Conn) -> redis::RedisResult<&[u8]> {
        let secret = self.secret.get_or_try_init(|| fetch(redis)).await?;
        Ok(secret)
    }

    /// The `Idempotency-Key` of operation `operation` of a handler
    /// namespace: the same in every process of the fleet and for every
    /// attempt, delivery and task that runs the operation.
    pub(crate) async fn idempotency_key(
        &self,
        redis: &mut Conn,
        namespace: &str,
        operation: &str,
    ) -> redis::RedisResult<String> {
        Ok(derive(self.get(redis).await?, namespace, operation))
    }
}

/// The fleet's own secret: written once, by whichever process comes first
/// (`SET NX`), and read by all.
async fn fetch(redis: &mut Conn) -> redis::RedisResult<Vec<u8>> {
    let fresh: [u8; 32] = rand::random();
    let (stored,): (Vec<u8>,) = redis::pipe()
        .cmd("SET")
        .arg(FLEET_SECRET_KEY)
        .arg(&fresh[..])
        .arg("NX")
        .ignore()
        .cmd("GET")
        .arg(FLEET_SECRET_KEY)
        .query_async(redis)
        .await?;
    Ok(stored)
}

/// HMAC-SHA256 under `secret` of the namespace and the operation, each
/// length-prefixed, as `dtq-` and 32 hex digits.
fn derive(secret: &[u8], namespace: &str, operation: &str) -> String {
    let mut mac = <Hmac<Sha256>>::new_from_slice(secret).expect("HMAC takes a key of any length");
    for part in [namespace, operation] {
        mac.update(&(part.len() as u64).to_be_bytes());
        mac.update(part.as_bytes());
    }
    let digest = mac.finalize().into_bytes();
    format!("{HOST_KEY_PREFIX}{}", hex::encode(&digest[..16]))
}

/// Whether `key`, sent by a handler itself, could be taken for a
/// host-derived key (ASCII case aside).
pub(crate) fn is_host_key(key: &[u8]) -> bool {
    key.len() >= HOST_KEY_PREFIX.len()
        && key[..HOST_KEY_PREFIX.len()].eq_ignore_ascii_case(HOST_KEY_PREFIX.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_key_is_stable_distinct_and_keyed() {
        let secret = [7u8; 32];
        let key = derive(&secret, "billing", "charge:1");
        assert_eq!(key, derive(&secret, "billing", "charge:1"));
        assert!(key.starts_with("dtq-") && key.len() == 36, "{key}");
        assert_ne!(key, derive(&secret, "billing", "charge:2"));
        assert_ne!(key, derive(&secret, "shipping", "charge:1"));
        // Parts are length-prefixed: moving a boundary changes the key.
        assert_ne!(derive(&secret, "ab", "c"), derive(&secret, "a", "bc"));
        // Another secret, another key: without it, no key can be computed.
        assert_ne!(key, derive(&[8u8; 32], "billing", "charge:1"));
    }

    #[test]
    fn keys_like_the_hosts_are_recognised() {
        assert!(is_host_key(b"dtq-0123"));
        assert!(is_host_key(b"DTQ-x"));
        assert!(!is_host_key(b"dtq"));
        assert!(!is_host_key(b"refund-A-1"));
    }

    #[test]
    fn a_short_secret_file_is_refused() -> Result<(), Box<dyn std::error::Error>> {
        let dir = std::env::temp_dir().join(format!("dtq-secret-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let short = dir.join("short");
        std::fs::write(&short, "too short\n")?;
        let refused = FleetSecret::new(Some(&short));
        assert!(matches!(
            refused,
            Err(SandboxError::FleetSecret { len: 9, .. })
        ));
        let good = dir.join("good");
        std::fs::write(&good, format!("{}\n", "k".repeat(44)))?;
        let secret = FleetSecret::new(Some(&good))?;
        assert_eq!(secret.secret.get().map(Vec::len), Some(44));
        std::fs::remove_dir_all(&dir)?;
        Ok(())
    }
}
