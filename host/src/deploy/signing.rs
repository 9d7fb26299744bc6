//! Signed modules: a fleet that runs only what a trusted key signed.
//!
//! With `--trusted-keys FILE`, a deploy must carry a signature, by one of
//! the file's keys, over the task, the module's digest and its settings.
//! The API checks it before it stores anything, and every worker checks it
//! again (and that the module's bytes hash to the digest) before it
//! compiles a version: a version written into Redis by someone who went
//! around the API, or a module swapped under a signed digest, is refused
//! by each worker and reported as a load failure (`dtq handlers`). Without
//! trusted keys nothing is checked, as before.
//!
//! What a key vouches for is [`signed_message`], the one encoding signer,
//! API and workers share. The signature is stored with the version in the
//! registry, so a rollback restores a version with its signature, and a
//! setting changed in Redis breaks it.
//!
//! # Formats
//!
//! - Public key (`NAME.pub`, and each line of a trusted-keys file):
//!   `dtq-ed25519 <base64 of the 32-byte ed25519 public key> <name>`.
//!   A trusted-keys file may hold blank lines and `#` comments.
//! - Private key (`NAME`, mode 0600): `dtq-ed25519-secret <base64 of the
//!   32-byte seed> <name>`.
//! - Signature: base64 of the 64-byte ed25519 signature, sent as the
//!   `Dtq-Signature` header of `PUT /v1/handlers/{task}` and stored as
//!   the version's `signature`.
//!
//! base64 is the standard alphabet with padding (RFC 4648 §4).

use std::io::Write as _;
use std::path::{Path, PathBuf};

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use ed25519_dalek::{Signature, Signer as _, SigningKey, VerifyingKey};
use sha2::{Digest as _, Sha256};

use super::settings::DeploySettings;

/// The first word of a public key line.
pub const PUBLIC_TAG: &str = "dtq-ed25519";
/// The first word of a private key file.
pub const SECRET_TAG: &str = "dtq-ed25519-secret";
/// The header of `PUT /v1/handlers/{task}` that carries the signature.
pub const SIGNATURE_HEADER: &str = "dtq-signature";

/// What a version's signature covers: the task, the module's SHA-256
/// (lowercase hex) and the settings, one per line after a versioned tag:
///
/// ```text
/// dtq-deploy-v1
/// <task>
/// <sha256 hex>
/// <settings JSON>
/// ```
///
/// The settings JSON is [`DeploySettings`] as the registry stores it:
/// fields in declaration order, unset ones left out, no spaces. The task
/// is in it so that a module signed for one task cannot be deployed as
/// another (with that one's queue and namespace).
pub fn signed_message(task: &str, digest: &str, settings: &DeploySettings) -> Vec<u8> {
    // Serializing a struct of strings and integers cannot fail.
    let settings = serde_json::to_string(settings).unwrap_or_default();
    format!("dtq-deploy-v1\n{task}\n{digest}\n{settings}").into_bytes()
}

/// Why a key, a key file or a signature cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum SigningError {
    /// A file cannot be read.
    #[error("cannot read {}: {source}", .path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A key file cannot be written (it exists already, say).
    #[error("cannot write {}: {source}", .path.display())]
    Write {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A line is not a key of the documented format.
    #[error("{}, line {line}: {reason}", .path.display())]
    BadKey {
        /// The file.
        path: PathBuf,
        /// Its number, from 1.
        line: usize,
        /// What is wrong.
        reason: String,
    },
    /// A trusted-keys file without a key: it would refuse every deploy.
    #[error("{}: no key (lines `{PUBLIC_TAG} <base64> <name>`)", .0.display())]
    NoKeys(PathBuf),
    /// A deploy without a signature to a fleet that requires one.
    #[error(
        "this fleet runs signed modules only (--trusted-keys): sign the deploy (`dtq deploy --sign-key KEY`)"
    )]
    Missing,
    /// Not base64 of 64 bytes.
    #[error("the signature is not base64 of a 64-byte ed25519 signature")]
    Malformed,
    /// No trusted key made this signature over this task, module and
    /// settings.
    #[error("no trusted key signed this task, module and settings")]
    Untrusted,
    /// The module's bytes do not hash to the digest the version names.
    #[error("the module's bytes hash to {actual}, not to the version's digest {expected}")]
    DigestMismatch {
        /// The version's digest.
        expected: String,
        /// The bytes' digest.
        actual: String,
    },
}

impl SigningError {
    /// Whether the deploy carried no signature (as opposed to a bad one).
    pub fn is_missing(&self) -> bool {
        matches!(self, SigningError::Missing)
    }
}

/// A private key, with its name.
pub struct SigningKeyFile {
    key: SigningKey,
    name: String,
}

impl std::fmt::Debug for SigningKeyFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key.
        write!(f, "SigningKeyFile({})", self.name)
    }
}

impl SigningKeyFile {
    /// A new key named `name`, from the operating system's randomness.
    pub fn generate(name: &str) -> SigningKeyFile {
        SigningKeyFile {
            key: SigningKey::from_bytes(&rand::random::<[u8; 32]>()),
            name: name.to_owned(),
        }
    }

    /// Write the pair: the private key to `path` (created, mode 0600; an
    /// existing file is not overwritten) and the public key to
    /// `path.pub`.
    pub fn write(&self, path: &Path) -> Result<PathBuf, SigningError> {
        use std::os::unix::fs::OpenOptionsExt as _;
        let public = public_path(path);
        let write = |path: &Path, text: &str, mode: u32| {
            std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(mode)
                .open(path)
                .and_then(|mut f| f.write_all(text.as_bytes()))
                .map_err(|source| SigningError::Write {
                    path: path.to_owned(),
                    source,
                })
        };
        let secret = format!(
            "{SECRET_TAG} {} {}\n",
            BASE64.encode(self.key.to_bytes()),
            self.name
        );
        write(path, &secret, 0o600)?;
        write(&public, &format!("{}\n", self.public_line()), 0o644)?;
        Ok(public)
    }

    /// Read a private key file.
    pub fn load(path: &Path) -> Result<SigningKeyFile, SigningError> {
        let text = read(path)?;
        let bad = |reason: &str| SigningError::BadKey {
            path: path.to_owned(),
            line: 1,
            reason: reason.to_owned(),
        };
        let (bytes, name) = parse_key_line(text.trim(), SECRET_TAG).map_err(|r| bad(&r))?;
        Ok(SigningKeyFile {
            key: SigningKey::from_bytes(&bytes),
            name,
        })
    }

    /// The public key line of this key.
    pub fn public_line(&self) -> String {
        let public = self.key.verifying_key();
        format!(
            "{PUBLIC_TAG} {} {}",
            BASE64.encode(public.to_bytes()),
            self.name
        )
    }

    /// The signature (base64) of `task`'s module `wasm` with `settings`.
    pub fn sign(&self, task: &str, wasm: &[u8], settings: &DeploySettings) -> String {
        let digest = hex::encode(Sha256::digest(wasm));
        let signature = self.key.sign(&signed_message(task, &digest, settings));
        BASE64.encode(signature.to_bytes())
    }
}

/// `path` with `.pub` added to its name.
fn public_path(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".pub");
    PathBuf::from(name)
}

fn read(path: &Path) -> Result<String, SigningError> {
    std::fs::read_to_string(path).map_err(|source| SigningError::Read {
        path: path.to_owned(),
        source,
    })
}

/// `<tag> <base64 of 32 bytes> <name>`: the bytes and the name.
fn parse_key_line(line: &str, tag: &str) -> Result<([u8; 32], String), String> {
    let fields: Vec<&str> = line.split_ascii_whitespace().collect();
    let [found, key, name] = fields.as_slice() else {
        return Err(format!("expected `{tag} <base64 key> <name>`"));
    };
    if *found != tag {
        return Err(format!("expected `{tag}`, found {found:?}"));
    }
    let bytes: [u8; 32] = BASE64
        .decode(key)
        .ok()
        .and_then(|b| b.try_into().ok())
        .ok_or("the key is not base64 of 32 bytes")?;
    Ok((bytes, (*name).to_owned()))
}

/// The public keys a fleet trusts (`--trusted-keys`). Cheap to clone.
#[derive(Clone, Default)]
pub struct TrustedKeys {
    keys: std::sync::Arc<Vec<(String, VerifyingKey)>>,
}

impl std::fmt::Debug for TrustedKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = self.keys.iter().map(|(n, _)| n.as_str()).collect();
        write!(f, "TrustedKeys({names:?})")
    }
}

impl TrustedKeys {
    /// Read a trusted-keys file: public key lines (the format of
    /// `NAME.pub`), blank lines and `#` comments. A file with no key is
    /// refused.
    pub fn load(path: &Path) -> Result<TrustedKeys, SigningError> {
        let text = read(path)?;
        let mut keys = Vec::new();
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let bad = |reason: String| SigningError::BadKey {
                path: path.to_owned(),
                line: n + 1,
                reason,
            };
            let (bytes, name) = parse_key_line(line, PUBLIC_TAG).map_err(bad)?;
            let key = VerifyingKey::from_bytes(&bytes)
                .map_err(|_| bad("not an ed25519 public key".into()))?;
            keys.push((name, key));
        }
        if keys.is_empty() {
            return Err(SigningError::NoKeys(path.to_owned()));
        }
        Ok(TrustedKeys {
            keys: std::sync::Arc::new(keys),
        })
    }

    /// The name of the trusted key whose `signature` (base64) is over
    /// `task`, `digest` and `settings` ([`signed_message`]). Strict
    /// verification: no malleable or small-order forms.
    pub fn verify(
        &self,
        task: &str,
        digest: &str,
        settings: &DeploySettings,
        signature: Option<&str>,
    ) -> Result<&str, SigningError> {
        let signature = signature.ok_or(SigningError::Missing)?;
        let bytes: [u8; 64] = BASE64
            .decode(signature.trim())
            .ok()
            .and_then(|b| b.try_into().ok())
            .ok_or(SigningError::Malformed)?;
        let signature = Signature::from_bytes(&bytes);
        let message = signed_message(task, digest, settings);
        self.keys
            .iter()
            .find(|(_, key)| key.verify_strict(&message, &signature).is_ok())
            .map(|(name, _)| name.as_str())
            .ok_or(SigningError::Untrusted)
    }

    /// [`TrustedKeys::verify`] for a module read back from the registry:
    /// its bytes must hash to `digest` first, so that a module replaced
    /// under a signed digest is refused too.
    pub fn verify_module(
        &self,
        task: &str,
        wasm: &[u8],
        digest: &str,
        settings: &DeploySettings,
        signature: Option<&str>,
    ) -> Result<&str, SigningError> {
        let actual = hex::encode(Sha256::digest(wasm));
        if actual != digest {
            return Err(SigningError::DigestMismatch {
                expected: digest.to_owned(),
                actual,
            });
        }
        self.verify(task, digest, settings, signature)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Dir(PathBuf);

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn dir(name: &str) -> Dir {
        let path = std::env::temp_dir().join(format!(
            "dtq-signing-{name}-{}",
            uuid::Uuid::now_v7().simple()
        ));
        std::fs::create_dir_all(&path).expect("temp dir");
        Dir(path)
    }

    fn settings(namespace: &str) -> DeploySettings {
        DeploySettings {
            namespace: Some(namespace.into()),
            ..DeploySettings::default()
        }
    }

    #[test]
    fn the_signed_message_is_tagged_and_canonical() {
        let message = signed_message("send", "ab12", &settings("mail"));
        assert_eq!(
            String::from_utf8(message).expect("text"),
            "dtq-deploy-v1\nsend\nab12\n{\"namespace\":\"mail\"}"
        );
    }

    #[test]
    fn a_written_pair_signs_what_its_public_half_verifies() -> Result<(), SigningError> {
        let dir = dir("pair");
        let path = dir.0.join("release");
        let public = SigningKeyFile::generate("release").write(&path)?;
        assert!(
            SigningKeyFile::generate("again").write(&path).is_err(),
            "overwrote a key"
        );
        use std::os::unix::fs::PermissionsExt as _;
        let mode = std::fs::metadata(&path).map(|m| m.permissions().mode() & 0o777);
        assert_eq!(mode.ok(), Some(0o600));

        let key = SigningKeyFile::load(&path)?;
        let trusted = TrustedKeys::load(&public)?;
        let wasm = b"\0asm module bytes";
        let digest = hex::encode(Sha256::digest(wasm));
        let signature = key.sign("send", wasm, &settings("mail"));
        let verify = |task, settings: &DeploySettings, sig: Option<&str>| {
            trusted
                .verify_module(task, wasm, &digest, settings, sig)
                .map(str::to_owned)
        };
        assert_eq!(
            verify("send", &settings("mail"), Some(&signature))?,
            "release"
        );
        // Another task, other settings, no or a broken signature, other
        // bytes: refused, each with its own error.
        assert!(matches!(
            verify("other", &settings("mail"), Some(&signature)),
            Err(SigningError::Untrusted)
        ));
        assert!(matches!(
            verify("send", &settings("billing"), Some(&signature)),
            Err(SigningError::Untrusted)
        ));
        assert!(matches!(
            verify("send", &settings("mail"), None),
            Err(SigningError::Missing)
        ));
        assert!(matches!(
            verify("send", &settings("mail"), Some("AAAA")),
            Err(SigningError::Malformed)
        ));
        let swapped = trusted.verify_module(
            "send",
            b"other",
            &digest,
            &settings("mail"),
            Some(&signature),
        );
        assert!(matches!(swapped, Err(SigningError::DigestMismatch { .. })));
        // A key the file does not hold.
        let stranger = SigningKeyFile::generate("stranger").sign("send", wasm, &settings("mail"));
        assert!(matches!(
            verify("send", &settings("mail"), Some(&stranger)),
            Err(SigningError::Untrusted)
        ));
        Ok(())
    }

    #[test]
    fn a_trusted_keys_file_names_its_bad_line_and_is_not_empty() {
        let dir = dir("trusted");
        let path = dir.0.join("keys");
        let good = SigningKeyFile::generate("a").public_line();
        for (text, line) in [
            (format!("# keys\n{good}\ndtq-ed25519 AAAA b\n"), Some(3)),
            (format!("{good}\nssh-ed25519 AAAA c\n"), Some(2)),
            ("# none\n\n".to_owned(), None),
        ] {
            std::fs::write(&path, text).expect("written");
            match TrustedKeys::load(&path) {
                Err(SigningError::BadKey { line: l, .. }) => assert_eq!(Some(l), line),
                Err(SigningError::NoKeys(_)) => assert_eq!(line, None),
                other => panic!("{other:?}"),
            }
        }
    }
}
