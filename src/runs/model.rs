//! Wire-independent run types and the pure validation of create and exec
//! requests. Every error names the field.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use sbx_runtime::Limits;

pub const DEFAULT_TTL_SECS: u64 = 30 * 60;
pub const MAX_TTL_SECS: u64 = 24 * 60 * 60;
pub const DEFAULT_EXEC_TIMEOUT_SECS: u64 = 60;
pub const MAX_EXEC_TIMEOUT_SECS: u64 = 600;
pub const MAX_ENV_VARS: usize = 64;
pub const MAX_ENV_BYTES: usize = 64 * 1024;
pub const HOST_IMAGE: &str = "host";

/// A 400 naming the field.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct FieldError {
    pub field: String,
    pub message: String,
}

pub fn field_err(field: &str, message: impl Into<String>) -> FieldError {
    FieldError {
        field: field.to_string(),
        message: message.into(),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Creating,
    Running,
    Killed,
    Expired,
    Error,
}

impl Status {
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Creating => "creating",
            Status::Running => "running",
            Status::Killed => "killed",
            Status::Expired => "expired",
            Status::Error => "error",
        }
    }
    pub fn parse(s: &str) -> Option<Status> {
        Some(match s {
            "creating" => Status::Creating,
            "running" => Status::Running,
            "killed" => Status::Killed,
            "expired" => Status::Expired,
            "error" => Status::Error,
            _ => return None,
        })
    }
    pub fn is_live(self) -> bool {
        matches!(self, Status::Creating | Status::Running)
    }
}

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct LimitsRequest {
    pub cpu: Option<f64>,
    pub memory_mb: Option<u64>,
    pub pids: Option<u32>,
}

/// `POST /v1/runs` body.
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct CreateRequest {
    pub image: Option<String>,
    pub template: Option<String>,
    pub env: Option<BTreeMap<String, String>>,
    pub ttl_sec: Option<u64>,
    pub network: Option<String>,
    pub egress_allow: Option<Vec<String>>,
    pub limits: Option<LimitsRequest>,
    pub warm: Option<Value>,
    pub labels: Option<BTreeMap<String, String>>,
    pub user: Option<String>,
    pub workdir: Option<String>,
}

/// A validated create request.
#[derive(Debug, Clone, PartialEq)]
pub struct CreatePlan {
    pub image: String,
    pub template: Option<String>,
    pub env: Vec<(String, String)>,
    pub ttl_secs: u64,
    pub network: String,
    /// The run's own allowlist entries (validated).
    pub egress_allow: Vec<String>,
    pub limits: Limits,
    pub labels: BTreeMap<String, String>,
    pub uid: u32,
    pub gid: u32,
    pub workdir: String,
}

/// `uid[:gid]`, numeric.
pub fn parse_user(s: &str) -> Result<(u32, u32), String> {
    let (u, g) = match s.split_once(':') {
        Some((u, g)) => (u, Some(g)),
        None => (s, None),
    };
    let uid: u32 = u
        .parse()
        .map_err(|_| format!("{s:?} is not uid[:gid] (numeric)"))?;
    let gid: u32 = match g {
        Some(g) => g
            .parse()
            .map_err(|_| format!("{s:?} is not uid[:gid] (numeric)"))?,
        None => uid,
    };
    Ok((uid, gid))
}

pub fn validate_env(
    field: &str,
    env: &BTreeMap<String, String>,
) -> Result<Vec<(String, String)>, FieldError> {
    if env.len() > MAX_ENV_VARS {
        return Err(field_err(
            field,
            format!("at most {MAX_ENV_VARS} variables"),
        ));
    }
    let mut total = 0;
    for (k, v) in env {
        let mut chars = k.chars();
        let ok_first = chars
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_');
        if !ok_first || !chars.all(|c| c.is_ascii_alphanumeric() || c == '_') {
            return Err(field_err(
                &format!("{field}.{k}"),
                "not a POSIX variable name",
            ));
        }
        if v.contains('\0') {
            return Err(field_err(&format!("{field}.{k}"), "value contains NUL"));
        }
        total += k.len() + v.len() + 2;
    }
    if total > MAX_ENV_BYTES {
        return Err(field_err(
            field,
            format!("more than {MAX_ENV_BYTES} bytes in total"),
        ));
    }
    Ok(env.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
}

fn validate_workdir(field: &str, w: &str) -> Result<String, FieldError> {
    if !w.starts_with('/') || w.split('/').any(|c| c == "..") || w.contains('\0') {
        return Err(field_err(field, "must be an absolute path without '..'"));
    }
    Ok(w.to_string())
}

fn validate_labels(labels: &BTreeMap<String, String>) -> Result<(), FieldError> {
    if labels.len() > 64 {
        return Err(field_err("labels", "at most 64 labels"));
    }
    for (k, v) in labels {
        let ok = !k.is_empty()
            && k.len() <= 63
            && k.chars()
                .all(|c| c.is_ascii_alphanumeric() || "._-/".contains(c));
        if !ok {
            return Err(field_err(
                &format!("labels.{k}"),
                "key must be 1-63 of [A-Za-z0-9._-/]",
            ));
        }
        if v.len() > 256 || v.contains('\0') {
            return Err(field_err(
                &format!("labels.{k}"),
                "value must be at most 256 bytes",
            ));
        }
    }
    Ok(())
}

impl CreateRequest {
    /// Validates against the template table; errors name the field.
    pub fn plan(
        self,
        templates: &BTreeMap<String, crate::config::Template>,
    ) -> Result<CreatePlan, FieldError> {
        let template = match &self.template {
            Some(name) => Some((
                name.clone(),
                templates.get(name).ok_or_else(|| {
                    let names: Vec<&str> = templates.keys().map(String::as_str).collect();
                    field_err(
                        "template",
                        format!("unknown template {name:?}; known: {}", names.join(", ")),
                    )
                })?,
            )),
            None => None,
        };
        let image = match (&self.image, &template) {
            (Some(_), Some(_)) => {
                return Err(field_err("image", "give image or template, not both"))
            }
            (Some(i), None) => {
                if i.is_empty()
                    || i.len() > 512
                    || i.chars().any(|c| c.is_whitespace() || c == '\0')
                {
                    return Err(field_err("image", "not an image reference"));
                }
                i.clone()
            }
            (None, Some((_, t))) => t.image.clone(),
            (None, None) => HOST_IMAGE.to_string(),
        };
        let ttl_secs = self.ttl_sec.unwrap_or(DEFAULT_TTL_SECS);
        if ttl_secs == 0 || ttl_secs > MAX_TTL_SECS {
            return Err(field_err("ttlSec", format!("must be 1 to {MAX_TTL_SECS}")));
        }
        let network = match self.network.as_deref().unwrap_or("none") {
            "none" => "none",
            "allowlist" | "egress" => "allowlist",
            "open" => "open",
            other => {
                return Err(field_err(
                    "network",
                    format!("{other:?} is not none, allowlist or open"),
                ))
            }
        }
        .to_string();
        if self.egress_allow.is_some() && network != "allowlist" {
            return Err(field_err(
                "egressAllow",
                format!("only allowed with network allowlist, not {network}"),
            ));
        }
        let egress_allow = self.egress_allow.clone().unwrap_or_default();
        if egress_allow.len() > 256 {
            return Err(field_err("egressAllow", "at most 256 entries"));
        }
        crate::egress::allowlist::parse_list(&egress_allow)
            .map_err(|e| field_err("egressAllow", format!("malformed entry {e}")))?;
        let mut limits = Limits::default();
        if let Some(l) = self.limits {
            if let Some(cpu) = l.cpu {
                if !(0.1..=64.0).contains(&cpu) || !cpu.is_finite() {
                    return Err(field_err("limits.cpu", "must be between 0.1 and 64"));
                }
                limits.cpu_millis = (cpu * 1000.0).round() as u32;
            }
            if let Some(m) = l.memory_mb {
                if !(64..=262_144).contains(&m) {
                    return Err(field_err(
                        "limits.memoryMb",
                        "must be between 64 and 262144",
                    ));
                }
                limits.memory_bytes = m << 20;
            }
            if let Some(p) = l.pids {
                if !(16..=65_536).contains(&p) {
                    return Err(field_err("limits.pids", "must be between 16 and 65536"));
                }
                limits.pids = p;
            }
        }
        let labels = self.labels.unwrap_or_default();
        validate_labels(&labels)?;
        let user_s = self
            .user
            .clone()
            .or_else(|| template.as_ref().map(|(_, t)| t.user.clone()))
            .unwrap_or_else(|| "1000:1000".into());
        let (uid, gid) = parse_user(&user_s).map_err(|m| field_err("user", m))?;
        let workdir = match (&self.workdir, &template) {
            (Some(w), _) => validate_workdir("workdir", w)?,
            (None, Some((_, t))) => t.workdir.clone(),
            (None, None) => "/work".into(),
        };
        let env = validate_env("env", &self.env.unwrap_or_default())?;
        Ok(CreatePlan {
            image,
            template: template.map(|(n, _)| n),
            env,
            ttl_secs,
            network,
            egress_allow,
            limits,
            labels,
            uid,
            gid,
            workdir,
        })
    }
}

/// `cmd`: a string for `/bin/sh -c`, or an argv array.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Cmd {
    Shell(String),
    Argv(Vec<String>),
}

/// `POST /v1/runs/{id}/exec` body.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ExecBody {
    pub cmd: Cmd,
    pub cwd: Option<String>,
    pub timeout_sec: Option<u64>,
    pub env: Option<BTreeMap<String, String>>,
    pub stdin: Option<String>,
    /// Lease credential (both or neither).
    pub owner: Option<String>,
    pub generation: Option<u64>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ExecPlan {
    pub argv: Vec<String>,
    pub cwd: Option<String>,
    pub timeout_secs: u64,
    pub env: Vec<(String, String)>,
    pub stdin: Vec<u8>,
    pub credential: Option<(String, u64)>,
}

/// A lease credential from its two halves: both or neither.
pub fn credential(
    owner: Option<String>,
    generation: Option<u64>,
) -> Result<Option<(String, u64)>, FieldError> {
    match (owner, generation) {
        (None, None) => Ok(None),
        (Some(o), Some(g)) => Ok(Some((validate_owner("owner", &o)?, g))),
        (Some(_), None) => Err(field_err("generation", "required with owner")),
        (None, Some(_)) => Err(field_err("owner", "required with generation")),
    }
}

/// A lease owner: 1 to 256 printable characters.
pub fn validate_owner(field: &str, o: &str) -> Result<String, FieldError> {
    if o.is_empty() || o.len() > 256 || o.chars().any(|c| c.is_control()) {
        return Err(field_err(field, "must be 1 to 256 printable characters"));
    }
    Ok(o.to_string())
}

impl ExecBody {
    pub fn plan(self) -> Result<ExecPlan, FieldError> {
        let argv = match self.cmd {
            Cmd::Shell(s) if s.trim().is_empty() => {
                return Err(field_err("cmd", "must not be empty"))
            }
            Cmd::Shell(s) => vec!["/bin/sh".into(), "-c".into(), s],
            Cmd::Argv(a) if a.is_empty() || a[0].is_empty() => {
                return Err(field_err("cmd", "must not be empty"))
            }
            Cmd::Argv(a) => a,
        };
        if argv.iter().any(|a| a.contains('\0')) {
            return Err(field_err("cmd", "contains NUL"));
        }
        let cwd = match self.cwd {
            Some(c) => Some(validate_workdir("cwd", &c)?),
            None => None,
        };
        let timeout_secs = self.timeout_sec.unwrap_or(DEFAULT_EXEC_TIMEOUT_SECS);
        if timeout_secs == 0 || timeout_secs > MAX_EXEC_TIMEOUT_SECS {
            return Err(field_err(
                "timeoutSec",
                format!("must be 1 to {MAX_EXEC_TIMEOUT_SECS}"),
            ));
        }
        let env = validate_env("env", &self.env.unwrap_or_default())?;
        let credential = credential(self.owner, self.generation)?;
        Ok(ExecPlan {
            credential,
            argv,
            cwd,
            timeout_secs,
            env,
            stdin: self.stdin.unwrap_or_default().into_bytes(),
        })
    }
}

/// The tier a `network` value names (`None` for `none`).
pub fn tier_of(network: &str) -> Option<sbx_netns::names::Tier> {
    match network {
        "allowlist" => Some(sbx_netns::names::Tier::Allowlist),
        "open" => Some(sbx_netns::names::Tier::Open),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(v: serde_json::Value) -> Result<CreatePlan, FieldError> {
        let r: CreateRequest = serde_json::from_value(v).expect("parse");
        r.plan(&crate::config::default_templates())
    }

    #[test]
    fn defaults_are_host_image_one_cpu_one_gib_256_pids() {
        let p = req(serde_json::json!({})).expect("plan");
        assert_eq!(p.image, "host");
        assert_eq!(
            p.limits,
            Limits {
                cpu_millis: 1000,
                memory_bytes: 1 << 30,
                pids: 256
            }
        );
        assert_eq!((p.uid, p.gid, p.ttl_secs), (1000, 1000, 1800));
        assert_eq!(p.network, "none");
        assert_eq!(p.workdir, "/work");
    }

    #[test]
    fn limits_are_range_checked_by_field() {
        for (body, field) in [
            (serde_json::json!({"limits": {"cpu": 0.05}}), "limits.cpu"),
            (
                serde_json::json!({"limits": {"memoryMb": 63}}),
                "limits.memoryMb",
            ),
            (
                serde_json::json!({"limits": {"pids": 70000}}),
                "limits.pids",
            ),
            (serde_json::json!({"ttlSec": 86401}), "ttlSec"),
            (serde_json::json!({"network": "wide"}), "network"),
            (serde_json::json!({"egressAllow": ["a.com"]}), "egressAllow"),
            (
                serde_json::json!({"network": "allowlist", "egressAllow": [".com"]}),
                "egressAllow",
            ),
            (serde_json::json!({"user": "root"}), "user"),
            (serde_json::json!({"workdir": "work"}), "workdir"),
            (serde_json::json!({"template": "nope"}), "template"),
            (serde_json::json!({"env": {"1BAD": "x"}}), "env.1BAD"),
            (serde_json::json!({"labels": {"": "x"}}), "labels."),
        ] {
            assert_eq!(
                req(body.clone()).expect_err("must fail").field,
                field,
                "{body}"
            );
        }
        let p = req(serde_json::json!({"limits": {"cpu": 0.5, "memoryMb": 64, "pids": 16}}))
            .expect("ok");
        assert_eq!(
            p.limits,
            Limits {
                cpu_millis: 500,
                memory_bytes: 64 << 20,
                pids: 16
            }
        );
    }

    #[test]
    fn templates_fill_image_user_and_workdir_and_egress_alias_normalizes() {
        let p = req(serde_json::json!({"template": "python", "network": "egress"})).expect("plan");
        assert_eq!(p.image, "python:3.12-slim");
        assert_eq!(p.template.as_deref(), Some("python"));
        assert_eq!(p.network, "allowlist");
        assert_eq!(
            req(serde_json::json!({"template": "python", "image": "x"}))
                .expect_err("both")
                .field,
            "image"
        );
    }

    #[test]
    fn unknown_fields_are_named() {
        let e = serde_json::from_value::<CreateRequest>(serde_json::json!({"imagee": "x"}))
            .expect_err("unknown");
        assert!(e.to_string().contains("imagee"), "{e}");
    }

    #[test]
    fn env_limits() {
        let many: BTreeMap<String, String> =
            (0..65).map(|i| (format!("V{i}"), "x".into())).collect();
        assert_eq!(
            validate_env("env", &many).expect_err("too many").field,
            "env"
        );
        let big: BTreeMap<String, String> = [("A".to_string(), "x".repeat(70_000))].into();
        assert_eq!(validate_env("env", &big).expect_err("too big").field, "env");
        let nul: BTreeMap<String, String> = [("A".to_string(), "a\0b".to_string())].into();
        assert_eq!(validate_env("env", &nul).expect_err("nul").field, "env.A");
    }

    #[test]
    fn exec_plans() {
        let b: ExecBody =
            serde_json::from_value(serde_json::json!({"cmd": "echo hi"})).expect("parse");
        let p = b.plan().expect("plan");
        assert_eq!(p.argv, vec!["/bin/sh", "-c", "echo hi"]);
        assert_eq!(p.timeout_secs, 60);
        let b: ExecBody =
            serde_json::from_value(serde_json::json!({"cmd": ["ls", "-l"], "timeoutSec": 601}))
                .expect("parse");
        assert_eq!(b.plan().expect_err("timeout").field, "timeoutSec");
        let b: ExecBody = serde_json::from_value(serde_json::json!({"cmd": []})).expect("parse");
        assert_eq!(b.plan().expect_err("empty").field, "cmd");
    }

    #[test]
    fn users() {
        assert_eq!(parse_user("0"), Ok((0, 0)));
        assert_eq!(parse_user("1000:50"), Ok((1000, 50)));
        assert!(parse_user("a:b").is_err());
    }
}
