//! The handler registry's scripts (`lua/`, with their shared
//! `lua/include/registry.lua`) and the ARGV each reads by name, which
//! `registry.rs` writes through [`Argv`](crate::store::scripts::Argv).

use std::sync::LazyLock;

use redis::Script;

use crate::store::scripts::{self, ArgvLayout};

macro_rules! registry_script {
    ($name:literal) => {
        LazyLock::new(|| {
            Script::new(concat!(
                include_str!("lua/include/registry.lua"),
                include_str!(concat!("lua/", $name, ".lua"))
            ))
        })
    };
}

pub(super) static DEPLOY: LazyLock<Script> = registry_script!("handler_deploy");
pub(super) static ROLLBACK: LazyLock<Script> = registry_script!("handler_rollback");
pub(super) static UNDEPLOY: LazyLock<Script> = registry_script!("handler_undeploy");
pub(super) static GC: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("lua/handler_gc.lua")));
pub(super) static REPORT: LazyLock<Script> =
    LazyLock::new(|| scripts::clocked(include_str!("lua/fleet_report.lua")));

/// `handler_deploy.lua`'s ARGV by name.
pub(super) static DEPLOY_ARGV: ArgvLayout = ArgvLayout {
    script: "handler_deploy",
    prefix: "ARG_",
    first: 1,
    names: &[
        "TASK",
        "DIGEST",
        "FINGERPRINT",
        "ENTRY",
        "MODULE",
        "BOUND",
        "CHANNEL",
        "PUBLISH",
    ],
    rest: None,
};

/// `handler_rollback.lua`'s ARGV by name.
pub(super) static ROLLBACK_ARGV: ArgvLayout = ArgvLayout {
    script: "handler_rollback",
    prefix: "ARG_",
    first: 1,
    names: &["TASK", "TO", "NOW", "BOUND", "CHANNEL", "PUBLISH"],
    rest: None,
};

/// `handler_undeploy.lua`'s ARGV by name.
pub(super) static UNDEPLOY_ARGV: ArgvLayout = ArgvLayout {
    script: "handler_undeploy",
    prefix: "ARG_",
    first: 1,
    names: &["TASK", "NOW", "BOUND", "CHANNEL", "PUBLISH"],
    rest: None,
};

/// `handler_gc.lua`'s ARGV by name: from `DIGESTS`, the digests whose
/// modules may go.
pub(super) static GC_ARGV: ArgvLayout = ArgvLayout {
    script: "handler_gc",
    prefix: "ARG_",
    first: 1,
    names: &[],
    rest: Some("DIGESTS"),
};

/// `fleet_report.lua`'s ARGV by name.
pub(super) static REPORT_ARGV: ArgvLayout = ArgvLayout {
    script: "fleet_report",
    prefix: "ARG_",
    first: 1,
    names: &["ID", "REPORT", "FORGET_MS"],
    rest: None,
};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::argv_check;

    /// Every registry script reads its ARGV by name, as its layout says.
    #[test]
    fn every_argv_layout_is_its_scripts_locals() {
        let text = |file: &str| argv_check::text("deploy", &["include/registry", file]);
        let layouts = [
            (&DEPLOY_ARGV, text("handler_deploy")),
            (&ROLLBACK_ARGV, text("handler_rollback")),
            (&UNDEPLOY_ARGV, text("handler_undeploy")),
            (&GC_ARGV, argv_check::text("deploy", &["handler_gc"])),
            (&REPORT_ARGV, argv_check::text("deploy", &["fleet_report"])),
        ];
        argv_check::check_room("deploy", &layouts, &[]);
    }
}
