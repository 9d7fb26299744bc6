//! The on-disk cache of compiled components, so that a restart does not
//! recompile every handler.
//!
//! An artifact is stored at `<dir>/<module sha256>-<engine key>.cwasm`. The
//! engine key hashes [`Engine::precompile_compatibility_hash`] (wasmtime
//! version, target, compiler flags, tunables such as fuel), so engines that
//! cannot share artifacts never look at each other's files.
//!
//! File layout: the artifact exactly as [`Component::serialize`] made it,
//! then the SHA-256 of those bytes, then the 8-byte [`MAGIC`]. Files are
//! written to a temporary name and renamed into place, so a reader never
//! sees a half-written file. On load, a file whose checksum does not match
//! (torn or rotted on disk) or that wasmtime refuses (made by an
//! incompatible engine) is logged, deleted and rebuilt; it is never loaded.
//!
//! # Trust
//!
//! An artifact is native code the worker runs as it is: the checksum catches
//! a torn or rotted file, not a forged one, since whoever can write the file
//! can write its checksum too. So the directory must be writable by this
//! user alone: it is created with mode 0700, and an existing one that is
//! group- or world-writable, or owned by another user, is refused at start
//! (`SandboxError::UntrustedCache`) rather than used.

use std::fs;
use std::hash::{Hash, Hasher};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use wasmtime::Engine;
use wasmtime::component::Component;

use super::SandboxError;
use super::outcome::{error_chain, error_line};

/// Trailer that marks a file as one of ours, with its format version.
const MAGIC: &[u8; 8] = b"dtqcwa01";
const DIGEST_LEN: usize = 32;

/// A compiled component and where it came from.
pub(crate) struct Compiled {
    pub(crate) component: Component,
    pub(crate) from_cache: bool,
    pub(crate) compile_time: Option<Duration>,
}

/// Where artifacts live (if anywhere) and the running engine's key.
pub(crate) struct ArtifactCache {
    dir: Option<PathBuf>,
    engine_key: String,
}

/// Feeds `Hash` output into SHA-256, so the key is stable across processes
/// (unlike `DefaultHasher`, which is only stable within one build).
struct Sha256Hasher(Sha256);

impl Hasher for Sha256Hasher {
    fn write(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }

    fn finish(&self) -> u64 {
        let digest = self.0.clone().finalize();
        u64::from_le_bytes(digest[..8].try_into().unwrap_or_default())
    }
}

/// Create `dir` (mode 0700) if missing, and check that nobody but this user
/// can write it.
fn prepare_private_dir(dir: &Path) -> Result<(), SandboxError> {
    use std::os::unix::fs::{DirBuilderExt as _, MetadataExt as _};

    let io = |source| SandboxError::Io {
        path: dir.to_path_buf(),
        source,
    };
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(io)?;
    let meta = fs::metadata(dir).map_err(io)?;
    // SAFETY: `geteuid` has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    let reason = if meta.uid() != me {
        Some(format!(
            "it is owned by uid {}, not this user ({me})",
            meta.uid()
        ))
    } else if meta.mode() & 0o022 != 0 {
        Some(format!(
            "others can write it (mode {:o}); run chmod go-w on it",
            meta.mode() & 0o777
        ))
    } else {
        None
    };
    match reason {
        Some(reason) => Err(SandboxError::UntrustedCache {
            path: dir.to_path_buf(),
            reason,
        }),
        None => Ok(()),
    }
}

/// The SHA-256 of `bytes`, in lowercase hex.
pub(crate) fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

impl ArtifactCache {
    pub(crate) fn new(dir: Option<PathBuf>, engine: &Engine) -> Result<Self, SandboxError> {
        if let Some(dir) = &dir {
            prepare_private_dir(dir)?;
        }
        let mut hasher = Sha256Hasher(Sha256::new());
        engine.precompile_compatibility_hash().hash(&mut hasher);
        let engine_key = hex::encode(&hasher.0.finalize()[..8]);
        Ok(ArtifactCache { dir, engine_key })
    }

    /// Where this engine's artifact of the module with SHA-256 `module_sha`
    /// is (or would be) stored.
    pub(crate) fn path_for(&self, module_sha: &str) -> Option<PathBuf> {
        let dir = self.dir.as_ref()?;
        Some(dir.join(format!("{module_sha}-{}.cwasm", self.engine_key)))
    }

    /// The component of `wasm`: deserialized from the cache when a good
    /// artifact is there, otherwise compiled (and then cached).
    pub(crate) fn load_or_compile(
        &self,
        engine: &Engine,
        wasm: &[u8],
        module_sha: &str,
    ) -> Result<Compiled, SandboxError> {
        let path = self.path_for(module_sha);
        if let Some(path) = &path {
            match read_artifact(engine, path) {
                Ok(Some(component)) => {
                    return Ok(Compiled {
                        component,
                        from_cache: true,
                        compile_time: None,
                    });
                }
                Ok(None) => {}
                Err(reason) => {
                    tracing::warn!(
                        path = %path.display(),
                        %reason,
                        "rejecting cached artifact; deleting and recompiling"
                    );
                    if let Err(e) = fs::remove_file(path) {
                        tracing::warn!(path = %path.display(), error = %e, "cannot delete rejected artifact");
                    }
                }
            }
        }

        let started = Instant::now();
        let component = Component::new(engine, wasm)
            .map_err(|e| SandboxError::InvalidModule(error_line(&e)))?;
        let compile_time = started.elapsed();
        if let Some(path) = &path {
            // The cache only saves time: failing to write it is not an error.
            if let Err(e) = write_artifact(&component, path) {
                tracing::warn!(path = %path.display(), error = %e, "cannot write artifact cache");
            }
        }
        Ok(Compiled {
            component,
            from_cache: false,
            compile_time: Some(compile_time),
        })
    }
}

/// `Ok(None)` when there is no artifact; `Err(reason)` when there is one
/// that must not be used.
fn read_artifact(engine: &Engine, path: &Path) -> Result<Option<Component>, String> {
    let bytes = match fs::read(path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("cannot read: {e}")),
    };
    let artifact = verify(&bytes)?;
    // SAFETY: `Component::deserialize` trusts its input to be an artifact made
    // by wasmtime, as it maps it as executable code. These bytes are: they
    // come from our own cache directory, which only `write_artifact` writes
    // (from `Component::serialize`, under a temporary name renamed into
    // place), and `verify` just checked the SHA-256 recorded when they were
    // written, so they are exactly those bytes. Wasmtime itself then checks
    // the artifact's header (wasmtime version, target, compiler flags and
    // tunables) against this engine and refuses an incompatible artifact
    // with an error, which we treat like any other bad artifact.
    let component = unsafe { Component::deserialize(engine, artifact) }
        .map_err(|e| format!("wasmtime refused it: {}", error_chain(&e)))?;
    Ok(Some(component))
}

/// The artifact inside a cache file, if its trailer and checksum are right.
fn verify(file: &[u8]) -> Result<&[u8], String> {
    let trailer = DIGEST_LEN + MAGIC.len();
    if file.len() < trailer || &file[file.len() - MAGIC.len()..] != MAGIC {
        return Err("not a dtq artifact (bad trailer)".to_string());
    }
    let (artifact, rest) = file.split_at(file.len() - trailer);
    if Sha256::digest(artifact).as_slice() != &rest[..DIGEST_LEN] {
        return Err("checksum mismatch (corrupt file)".to_string());
    }
    Ok(artifact)
}

fn write_artifact(component: &Component, path: &Path) -> Result<(), String> {
    let artifact = component.serialize().map_err(|e| error_chain(&e))?;
    let digest = Sha256::digest(&artifact);
    let dir = path.parent().unwrap_or(Path::new("."));
    let file_name = path
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("artifact");
    let tmp = dir.join(format!(
        ".{file_name}.{}.{}.tmp",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default()
    ));
    let write = || -> std::io::Result<()> {
        let mut file = fs::File::create(&tmp)?;
        file.write_all(&artifact)?;
        file.write_all(&digest)?;
        file.write_all(MAGIC)?;
        file.sync_all()?;
        fs::rename(&tmp, path)
    };
    write().map_err(|e| {
        let _ = fs::remove_file(&tmp);
        e.to_string()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verify_checks_trailer_and_checksum() {
        let mut file = b"artifact".to_vec();
        file.extend_from_slice(&Sha256::digest(b"artifact"));
        file.extend_from_slice(MAGIC);
        assert_eq!(verify(&file), Ok(&b"artifact"[..]));
        file[0] ^= 1;
        assert!(verify(&file).is_err());
        assert!(verify(b"short").is_err());
    }
}
