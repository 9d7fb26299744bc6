//! The fleet limits of a token's grant: which tasks it may deploy, roll
//! back, undeploy and schedule, and which namespaces, hosts and kv quota
//! the versions it makes active may be given.
//!
//! Handlers, namespaces, allow-lists, partitions and schedules belong to the
//! fleet, not to a queue: a deploy puts code of the deployer's choosing on
//! every worker, in a namespace (another tenant's kv and claims, if it names
//! theirs), with network access to what its allow-list names. So a grant on
//! some queues confers none of that; a grant must name what it may give.
//! The token format and the route table are in `auth.rs`.

use serde_json::{Value, json};

use crate::deploy::DeploySettings;
use crate::sandbox::AllowList;

/// Names a grant is limited to: comma-separated, each a name, a prefix
/// ending in `*` (`billing-*`), or `*` (every name).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Names(Vec<NamePattern>);

#[derive(Debug, Clone, PartialEq, Eq)]
enum NamePattern {
    Exact(String),
    Prefix(String),
}

impl Names {
    fn parse(field: &str) -> Result<Names, String> {
        let mut names = Vec::new();
        for item in field.split(',') {
            let (stem, prefix) = match item.strip_suffix('*') {
                Some(stem) => (stem, true),
                None => (item, false),
            };
            let valid = stem
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "_.-:".contains(c));
            if !valid || (stem.is_empty() && !prefix) {
                return Err(format!(
                    "{item:?} is not a name or a prefix ending in `*` \
                     (letters, digits, `_`, `.`, `-`, `:`)"
                ));
            }
            names.push(if prefix {
                NamePattern::Prefix(stem.to_owned())
            } else {
                NamePattern::Exact(stem.to_owned())
            });
        }
        Ok(Names(names))
    }

    /// Whether `name` is among them.
    pub(super) fn matches(&self, name: &str) -> bool {
        self.0.iter().any(|p| match p {
            NamePattern::Exact(n) => n == name,
            NamePattern::Prefix(p) => name.starts_with(p.as_str()),
        })
    }
}

/// The hosts a deploy grant may put in an allow-list.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Hosts {
    /// `hosts=*`: any allow-list.
    Any,
    /// Patterns each of the deploy's patterns must fall within.
    Within(AllowList),
}

/// A grant's `key=value` fields. Absent fields mean: every task, only each
/// task's own namespace (its name, the default), no allow-list, and no
/// `kv_quota_mib` of the deploy's own (the workers' `--kv-quota-mib`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct Limits {
    /// `tasks=`: `None`, every task.
    pub(super) tasks: Option<Names>,
    /// `namespaces=`: `None`, each task's own only.
    namespaces: Option<Names>,
    /// `hosts=`: `None`, no allow-list.
    hosts: Option<Hosts>,
    /// `kv_quota_mib=N`: the largest quota a deploy may set (1 to N);
    /// `None`, it may set none.
    kv_quota_mib: Option<u64>,
}

/// What a grant is refused for, with the thing it does not cover: the
/// message and the details of the 403.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Uncovered {
    pub(super) message: String,
    pub(super) details: Value,
}

impl Limits {
    /// Parse one `key=value` field into these limits.
    pub(super) fn parse_field(&mut self, field: &str) -> Result<(), String> {
        let Some((key, value)) = field.split_once('=') else {
            return Err(format!("expected `key=value`, found {field:?}"));
        };
        let star = value == "*";
        let duplicate = || format!("`{key}=` is given twice");
        match key {
            "tasks" if self.tasks.is_some() => return Err(duplicate()),
            "tasks" => self.tasks = Some(Names::parse(value)?),
            "namespaces" if self.namespaces.is_some() => return Err(duplicate()),
            "namespaces" => self.namespaces = Some(Names::parse(value)?),
            "hosts" if self.hosts.is_some() => return Err(duplicate()),
            "hosts" if star => self.hosts = Some(Hosts::Any),
            "hosts" => {
                let list = AllowList::parse(value).map_err(|e| e.to_string())?;
                self.hosts = Some(Hosts::Within(list));
            }
            "kv_quota_mib" if self.kv_quota_mib.is_some() => return Err(duplicate()),
            "kv_quota_mib" => {
                let mib = value.parse::<u64>().ok().filter(|&n| n >= 1);
                self.kv_quota_mib = Some(mib.ok_or("`kv_quota_mib=` must be at least 1")?);
            }
            _ => {
                return Err(format!(
                    "unknown field {key:?}; the fields are tasks, namespaces, hosts, kv_quota_mib"
                ));
            }
        }
        Ok(())
    }

    /// Whether any field is given.
    pub(super) fn any(&self) -> bool {
        *self != Limits::default()
    }

    /// Whether only `tasks=` is given (what an `admin` grant may carry).
    pub(super) fn tasks_only(&self) -> bool {
        Limits {
            tasks: None,
            ..self.clone()
        } == Limits::default()
    }

    /// Whether `task` is among the tasks (every task without `tasks=`).
    pub(super) fn covers_task(&self, task: &str) -> bool {
        self.tasks.as_ref().is_none_or(|t| t.matches(task))
    }

    /// Why a version of `task` with `settings` may not be made active
    /// under these limits; `None` when it may.
    pub(super) fn refuse_version(
        &self,
        task: &str,
        settings: &DeploySettings,
    ) -> Option<Uncovered> {
        if !self.covers_task(task) {
            return Some(Uncovered {
                message: format!("no deploy grant of this token covers task {task:?}"),
                details: json!({"scope": "deploy", "task": task}),
            });
        }
        let namespace = settings.namespace.as_deref().unwrap_or(task);
        let namespace_ok = match &self.namespaces {
            Some(names) => names.matches(namespace),
            None => namespace == task,
        };
        if !namespace_ok {
            return Some(Uncovered {
                message: format!(
                    "this token's deploy grant does not cover namespace {namespace:?} \
                     (without `namespaces=` a task runs only in its own)"
                ),
                details: json!({"scope": "deploy", "task": task, "namespace": namespace}),
            });
        }
        // What a handler may submit reaches other queues and their
        // tenants: the operator's to grant, never a deploy grant's.
        if let Some(grants) = settings
            .submit_to
            .as_deref()
            .filter(|g| !g.trim().is_empty())
        {
            return Some(Uncovered {
                message: format!(
                    "submit_to={grants:?} needs the fleet operator's token: a deploy grant \
                     cannot let a handler submit to queues"
                ),
                details: json!({"scope": "deploy", "task": task, "submit_to": grants}),
            });
        }
        if let Some(host) = self.uncovered_host(settings) {
            return Some(Uncovered {
                message: format!(
                    "this token's deploy grant does not cover allow_hosts pattern {host:?}"
                ),
                details: json!({"scope": "deploy", "task": task, "host": host}),
            });
        }
        match (settings.kv_quota_mib, self.kv_quota_mib) {
            (Some(asked), Some(max)) if (1..=max).contains(&asked) => None,
            (None, _) => None,
            (Some(asked), max) => Some(Uncovered {
                message: format!(
                    "this token's deploy grant does not cover kv_quota_mib={asked} \
                     (it may give 1 to {}; 0 is no budget)",
                    max.map_or("none".to_owned(), |m| m.to_string())
                ),
                details: json!({"scope": "deploy", "task": task, "kv_quota_mib": asked}),
            }),
        }
    }

    /// The first `allow_hosts` pattern of `settings` the grant does not
    /// cover.
    fn uncovered_host(&self, settings: &DeploySettings) -> Option<String> {
        let asked = settings.allow_hosts.as_deref()?;
        let Ok(asked) = AllowList::parse(asked) else {
            // Checked before (`DeploySettings::check`); unparsable is not
            // covered.
            return Some(asked.to_owned());
        };
        let nothing = AllowList::default();
        let mine = match &self.hosts {
            Some(Hosts::Any) => return None,
            Some(Hosts::Within(mine)) => mine,
            None => &nothing,
        };
        mine.uncovered(&asked).map(str::to_owned)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(fields: &str) -> Limits {
        let mut limits = Limits::default();
        for field in fields.split(' ').filter(|f| !f.is_empty()) {
            limits.parse_field(field).expect("parses");
        }
        limits
    }

    fn settings(
        namespace: Option<&str>,
        hosts: Option<&str>,
        quota: Option<u64>,
    ) -> DeploySettings {
        DeploySettings {
            namespace: namespace.map(str::to_owned),
            allow_hosts: hosts.map(str::to_owned),
            kv_quota_mib: quota,
            ..DeploySettings::default()
        }
    }

    /// The detail that names what was refused, or "ok".
    fn refusal(limits: &Limits, task: &str, settings: &DeploySettings) -> String {
        match limits.refuse_version(task, settings) {
            None => "ok".into(),
            Some(u) => {
                let mut fields: Vec<String> = u.details.as_object().map_or(Vec::new(), |o| {
                    o.keys()
                        .filter(|k| *k != "scope" && *k != "task")
                        .cloned()
                        .collect()
                });
                fields.sort();
                if fields.is_empty() {
                    "task".into()
                } else {
                    fields.join(",")
                }
            }
        }
    }

    #[test]
    fn absent_fields_give_every_task_its_own_namespace_and_nothing_more() {
        let none = Limits::default();
        assert_eq!(refusal(&none, "a", &DeploySettings::default()), "ok");
        assert_eq!(refusal(&none, "a", &settings(Some("a"), None, None)), "ok");
        assert_eq!(
            refusal(&none, "a", &settings(Some("billing"), None, None)),
            "namespace"
        );
        assert_eq!(
            refusal(&none, "a", &settings(None, Some("http://10.0.0.1:*"), None)),
            "host"
        );
        assert_eq!(
            refusal(&none, "a", &settings(None, None, Some(0))),
            "kv_quota_mib"
        );
        assert_eq!(
            refusal(&none, "a", &settings(None, None, Some(5))),
            "kv_quota_mib"
        );
    }

    #[test]
    fn fields_bound_tasks_namespaces_hosts_and_quota() {
        let l = limits(
            "tasks=send_*,report namespaces=mail,team-* hosts=https://*.example.com kv_quota_mib=8",
        );
        assert_eq!(
            refusal(&l, "send_mail", &settings(Some("mail"), None, None)),
            "ok"
        );
        assert_eq!(
            refusal(&l, "report", &settings(Some("team-a"), None, Some(8))),
            "ok"
        );
        assert_eq!(refusal(&l, "reports", &DeploySettings::default()), "task");
        assert_eq!(
            refusal(&l, "send_x", &settings(Some("billing"), None, None)),
            "namespace"
        );
        // Its own namespace is not implied once `namespaces=` is given.
        assert_eq!(
            refusal(&l, "report", &DeploySettings::default()),
            "namespace"
        );
        let hosts = settings(
            Some("mail"),
            Some("https://api.example.com,http://10.0.0.1"),
            None,
        );
        assert_eq!(refusal(&l, "send_x", &hosts), "host");
        assert_eq!(
            refusal(&l, "send_x", &settings(Some("mail"), None, Some(9))),
            "kv_quota_mib"
        );
        assert_eq!(
            refusal(&l, "send_x", &settings(Some("mail"), None, Some(0))),
            "kv_quota_mib"
        );
        let any = limits("hosts=* namespaces=*");
        assert_eq!(
            refusal(
                &any,
                "x",
                &settings(Some("y"), Some("http://10.0.0.1:*"), None)
            ),
            "ok"
        );
    }

    #[test]
    fn no_deploy_grant_lets_a_handler_submit_to_queues() {
        let submit = |grants: &str| DeploySettings {
            submit_to: Some(grants.to_owned()),
            ..DeploySettings::default()
        };
        for l in [Limits::default(), limits("tasks=* namespaces=* hosts=*")] {
            assert_eq!(
                refusal(&l, "fan_out", &submit("default:square")),
                "submit_to"
            );
            assert_eq!(
                refusal(&l, "fan_out", &submit("")),
                "ok",
                "an empty grant grants nothing"
            );
        }
    }

    #[test]
    fn bad_fields_are_refused() {
        for field in [
            "tasks=",
            "tasks=a,,b",
            "tasks=a*b",
            "hosts=10.0.0.1",
            "kv_quota_mib=0",
            "nope=1",
            "tasks",
        ] {
            assert!(Limits::default().parse_field(field).is_err(), "{field}");
        }
        let mut twice = limits("tasks=a");
        assert!(twice.parse_field("tasks=b").is_err());
    }
}
