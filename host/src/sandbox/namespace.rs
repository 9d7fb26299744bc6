//! Which slice of Redis a handler may reach, and how its keys are named.
//!
//! The namespace is the operator's to give: by default it is the task name;
//! [`HandlerSettings::namespace`](super::HandlerSettings::namespace) (the
//! `--namespace TASK=NS` flag) gives another. A component may *ask* for one
//! with a custom section named [`NAMESPACE_SECTION`] (in the component itself
//! or in any core module nested inside it), but it is loaded only when the
//! operator gave it exactly that namespace: a component cannot make itself a
//! co-tenant of another handler's keys and claims.
//!
//! Every key a guest names becomes a suffix of `dtq:guest:{<namespace>}:`,
//! and every idempotency claim a suffix of `dtq:claim:{<namespace>}:`; the
//! guest's text is never parsed, so a key such as `../dtq:task:{q}:x` is just
//! an odd name inside the namespace, and no kv key can name a claim. The
//! namespace in braces is a Redis Cluster hash tag: one namespace's keys and
//! claims share a slot, which lets one script commit an operation's kv
//! writes with its claim.

use wasmparser::{Parser, Payload};

use super::SandboxError;

/// Name of the custom section in which a component asks for a namespace.
pub const NAMESPACE_SECTION: &str = "dtq-namespace";

/// Longest namespace accepted, in bytes.
pub const MAX_NAMESPACE_BYTES: usize = 64;

/// Prefix of every key a guest can reach.
pub const GUEST_KEY_PREFIX: &str = "dtq:guest:";

/// Prefix of every idempotency claim.
pub const CLAIM_KEY_PREFIX: &str = "dtq:claim:";

/// The namespace `task`'s handler runs in: the operator's `granted` one, or
/// the task name; refused when the component asks for another.
pub(crate) fn namespace_of(
    task: &str,
    wasm: &[u8],
    granted: Option<&str>,
) -> Result<String, SandboxError> {
    let namespace = granted.unwrap_or(task).to_string();
    validate(&namespace)?;
    if let Some(asked) = custom_namespace(wasm)?
        && asked != namespace
    {
        return Err(SandboxError::NamespaceNotGranted {
            task: task.to_string(),
            asked,
            granted: namespace,
        });
    }
    Ok(namespace)
}

/// The contents of the `dtq-namespace` section, if the component has one.
///
/// Several copies (e.g. one per nested module) must agree.
fn custom_namespace(wasm: &[u8]) -> Result<Option<String>, SandboxError> {
    let mut found: Option<String> = None;
    // `parse_all` descends into nested modules and components by itself.
    for payload in Parser::new(0).parse_all(wasm) {
        let payload = payload.map_err(|e| {
            let text = e.to_string();
            SandboxError::InvalidModule(text.split_whitespace().collect::<Vec<_>>().join(" "))
        })?;
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

/// The prefix of every kv key of `namespace`.
pub(crate) fn kv_prefix(namespace: &str) -> String {
    format!("{GUEST_KEY_PREFIX}{{{namespace}}}:")
}

/// The prefix of every idempotency claim of `namespace`.
pub(crate) fn claim_prefix(namespace: &str) -> String {
    format!("{CLAIM_KEY_PREFIX}{{{namespace}}}:")
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
    fn kv_keys_and_claims_share_a_slot_and_never_a_prefix() {
        assert_eq!(kv_prefix("adversarial"), "dtq:guest:{adversarial}:");
        assert_eq!(claim_prefix("ns"), "dtq:claim:{ns}:");
        assert!(!claim_prefix("ns").starts_with(GUEST_KEY_PREFIX));
    }

    #[test]
    fn the_operator_grants_the_namespace() {
        let plain = wat_component(None);
        let asks = wat_component(Some("billing"));
        let ns = |task, wasm: &[u8], granted| {
            namespace_of(task, wasm, granted).map_err(|e| e.to_string())
        };
        assert_eq!(
            ns("send_receipt", &plain, None).as_deref(),
            Ok("send_receipt")
        );
        assert_eq!(
            ns("send_receipt", &plain, Some("billing")).as_deref(),
            Ok("billing")
        );
        assert_eq!(
            ns("refund", &asks, Some("billing")).as_deref(),
            Ok("billing")
        );
        let refused = ns("refund", &asks, None).unwrap_err();
        assert!(refused.contains("--namespace refund=billing"), "{refused}");
        assert!(ns("refund", &asks, Some("refunds")).is_err());
        assert!(ns("bad:name", &plain, None).is_err());
    }

    /// The smallest component, with a `dtq-namespace` section if asked.
    fn wat_component(namespace: Option<&str>) -> Vec<u8> {
        // A component header (`\0asm`, version 0x0d, layer 1), then one
        // custom section: id 0, size, name, contents.
        let mut wasm = b"\0asm\x0d\0\x01\0".to_vec();
        if let Some(ns) = namespace {
            let mut section = vec![NAMESPACE_SECTION.len() as u8];
            section.extend_from_slice(NAMESPACE_SECTION.as_bytes());
            section.extend_from_slice(ns.as_bytes());
            wasm.push(0);
            wasm.push(section.len() as u8);
            wasm.extend(section);
        }
        wasm
    }
}
