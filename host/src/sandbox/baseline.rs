//! Bare wasmtime, for the sandbox benchmark's baseline: the same engine
//! (its settings and its pooling allocator), the same compiled component
//! and `InstancePre`, a new `Store` per call, and nothing of dtq's around
//! the call: no WASI context, no host state, no limits, no deadline, no
//! cancel, no outcome mapping. Its imports trap if called, so it runs only
//! guests whose call imports nothing (`echo`).
//!
//! What `Sandbox::call` costs over [`Baseline::call`] is what dtq adds per
//! call (`cargo bench -p dtq-tests --bench sandbox` prints the ratio).

use wasmtime::Store;
use wasmtime::component::{Component, Linker};

use super::imports::bindings::{self, HandlerPre};
use super::outcome::error_chain;
use super::{Sandbox, SandboxError};

/// A pre-instantiated component on a sandbox's engine, called bare.
pub struct Baseline {
    pre: HandlerPre<()>,
}

impl Baseline {
    /// Compile `wasm` on `sandbox`'s engine and pre-instantiate it with
    /// every import a trap.
    pub fn new(sandbox: &Sandbox, wasm: &[u8]) -> Result<Baseline, SandboxError> {
        let engine = &sandbox.inner.engine;
        let component =
            Component::new(engine, wasm).map_err(|e| SandboxError::Engine(error_chain(&e)))?;
        let mut linker = Linker::<()>::new(engine);
        linker
            .define_unknown_imports_as_traps(&component)
            .map_err(|e| SandboxError::Engine(error_chain(&e)))?;
        let pre = linker
            .instantiate_pre(&component)
            .and_then(HandlerPre::new)
            .map_err(|e| SandboxError::Engine(error_chain(&e)))?;
        Ok(Baseline { pre })
    }

    /// Instantiate in a new store, call `handle` with `payload`, drop the
    /// store. The handler's own error comes back as `Ok(Err(message))`.
    pub async fn call(&self, payload: &str) -> Result<Result<String, String>, SandboxError> {
        let mut store = Store::new(self.pre.engine(), ());
        // The engine interrupts by epoch: without a deadline the first
        // check would trap.
        store.set_epoch_deadline(1 << 40);
        let ctx = bindings::TaskContext {
            task_id: "baseline".into(),
            queue: "default".into(),
            task_name: "echo".into(),
            attempt: 1,
            max_attempts: 1,
            idempotency_key: None,
            deadline_ms: 60_000,
        };
        let instance = self
            .pre
            .instantiate_async(&mut store)
            .await
            .map_err(|e| SandboxError::Engine(error_chain(&e)))?;
        let result = instance
            .call_handle(&mut store, &ctx, payload)
            .await
            .map_err(|e| SandboxError::Engine(error_chain(&e)))?;
        Ok(result.map_err(|e| format!("{e:?}")))
    }
}
