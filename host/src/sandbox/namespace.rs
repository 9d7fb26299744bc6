//! Which slice of Redis a handler may reach, and how its keys are named.
//!
//! A handler's namespace is its task name unless the component carries a
//! custom section named [`NAMESPACE_SECTION`] (in the component itself or in
//! any core module nested inside it): then the section's UTF-8 contents are
//! the namespace. That lets several handlers share one slice on purpose.
//!
//! Every key a guest names becomes a suffix of
//! `dtq:guest:<namespace>:`; the guest's text is never parsed, so a key such
//! as `../dtq:task:{q}:x` is just an odd name inside the namespace.

use wasmparser::{Parser, Payload};

use super::SandboxError;

/// Name of the custom section that overrides a handler's namespace.
pub const NAMESPACE_SECTION: &str = "dtq-namespace";

/// Longest namespace accepted, in bytes.
pub const MAX_NAMESPACE_BYTES: usize = 64;

/// Prefix of every key a guest can reach.
pub const GUEST_KEY_PREFIX: &str = "dtq:guest:";

/// The namespace `task`'s component asks for, or the task name.
pub(crate) fn namespace_of(task: &str, wasm: &[u8]) -> Result<String, SandboxError> {
    let namespace = match custom_namespace(wasm)? {
        Some(ns) => ns,
        None => task.to_string(),
    };
    validate(&namespace)?;
    Ok(namespace)
}

/// The contents of the `dtq-namespace` section, if the component has one.
///
/// Several copies (e.g. one per nested module) must agree.
fn custom_namespace(wasm: &[u8]) -> Result<Option<String>, SandboxError> {
    let mut found: Option<String> = None;
    // `parse_all` descends into nested modules and components by itself.
    for payload in Parser::new(0).parse_all(wasm) {
        let payload = payload.map_err(|e| SandboxError::InvalidModule(e.to_string()))?;
        let Payload::CustomSection(section) = payload else {
            continue;
        };
        if section.name() != NAMESPACE_SECTION {
            continue;
        }
        let text = std::str::from_utf8(section.data())
            .map_err(|_| SandboxError::InvalidNamespace {
                namespace: String::from_utf8_lossy(section.data()).into_owned(),
                reason: "the dtq-namespace section is not UTF-8",
            })?
            .trim()
            .to_string();
        match &found {
            Some(previous) if *previous != text => {
                return Err(SandboxError::InvalidNamespace {
                    namespace: text,
                    reason: "the component has dtq-namespace sections that disagree",
                });
            }
            _ => found = Some(text),
        }
    }
    Ok(found)
}

/// A namespace is 1 to 64 bytes of `[A-Za-z0-9_.-]`: it must not contain the
/// `:` that separates key segments, nor anything a Redis client might
/// mishandle.
pub(crate) fn validate(namespace: &str) -> Result<(), SandboxError> {
    let reason = if namespace.is_empty() {
        "it is empty"
    } else if namespace.len() > MAX_NAMESPACE_BYTES {
        "it is longer than 64 bytes"
    } else if !namespace
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
    {
        "only A-Z, a-z, 0-9, '_', '.' and '-' are allowed"
    } else {
        return Ok(());
    };
    Err(SandboxError::InvalidNamespace {
        namespace: namespace.to_string(),
        reason,
    })
}

/// The Redis key of a guest's `key` in `namespace`.
pub(crate) fn kv_key(namespace: &str, key: &str) -> String {
    format!("{GUEST_KEY_PREFIX}{namespace}:{key}")
}

/// The Redis key of an idempotency claim on `key` in `namespace`.
pub(crate) fn claim_key(namespace: &str, key: &str) -> String {
    format!("{GUEST_KEY_PREFIX}{namespace}:idem:{key}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validates_namespaces() {
        assert!(validate("send_receipt").is_ok());
        assert!(validate("shared-ns.v2").is_ok());
        assert!(validate("").is_err());
        assert!(validate("a:b").is_err());
        assert!(validate("../x").is_err());
        assert!(validate(&"a".repeat(65)).is_err());
    }

    #[test]
    fn keys_are_suffixes() {
        assert_eq!(
            kv_key("adversarial", "../../dtq:task:{q}:x"),
            "dtq:guest:adversarial:../../dtq:task:{q}:x"
        );
        assert_eq!(claim_key("ns", "k"), "dtq:guest:ns:idem:k");
    }
}
