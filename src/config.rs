//! Configuration: `/etc/sbx/config.toml`, overridden by `SBX_*` variables,
//! overridden by flags, validated once into [`Config`]. A malformed value
//! refuses to start with a message naming the key.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;

use serde::Deserialize;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("read config file {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("config file {path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("{key}: {reason}")]
    Invalid { key: String, reason: String },
}

fn invalid(key: &str, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key: key.to_string(),
        reason: reason.into(),
    }
}

/// One entry of the template table.
#[derive(Debug, Clone, Deserialize, serde::Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Template {
    pub image: String,
    #[serde(default = "default_user")]
    pub user: String,
    #[serde(default = "default_workdir")]
    pub workdir: String,
}

fn default_user() -> String {
    "1000:1000".into()
}
fn default_workdir() -> String {
    "/work".into()
}

/// The file form: every key optional.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct FileConfig {
    pub listen: Option<String>,
    pub listen_public: Option<bool>,
    pub state_dir: Option<PathBuf>,
    pub server_name: Option<String>,
    pub runtime: Option<String>,
    pub egress_allow: Option<String>,
    pub subnet: Option<String>,
    pub proxy_ports: Option<String>,
    pub cache_root: Option<PathBuf>,
    pub cache_max_gb: Option<u64>,
    pub insecure_registry: Option<Vec<String>>,
    pub max_file_mb: Option<u64>,
    pub reaper_tick_secs: Option<u64>,
    pub unpack_max_mb: Option<u64>,
    pub unpack_max_entries: Option<u64>,
    pub stop_runs_on_exit: Option<bool>,
    pub cgroup_favordynmods: Option<bool>,
    pub registry_auth: Option<BTreeMap<String, RegistryAuth>>,
    pub templates: Option<BTreeMap<String, Template>>,
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RegistryAuth {
    pub username: String,
    pub password: String,
}

/// Flags given to `sbx serve` (each `None` when absent).
#[derive(Debug, Default, Clone, clap::Args)]
pub struct ServeFlags {
    /// Address to listen on (default 127.0.0.1:7439).
    #[arg(long)]
    pub listen: Option<String>,
    /// Allow a non-loopback listen address.
    #[arg(long)]
    pub listen_public: bool,
    #[arg(long)]
    pub state_dir: Option<PathBuf>,
    #[arg(long)]
    pub config: Option<PathBuf>,
    #[arg(long)]
    pub server_name: Option<String>,
    /// native (default), runsc, or a path to an OCI runtime.
    #[arg(long)]
    pub runtime: Option<String>,
    /// Deployment-wide egress allowlist (comma-separated entries).
    #[arg(long)]
    pub egress_allow: Option<String>,
    /// Sandbox subnet, e.g. 10.88.0.0/20 (default: derived from the state dir).
    #[arg(long)]
    pub subnet: Option<String>,
    #[arg(long)]
    pub cache_root: Option<PathBuf>,
    #[arg(long)]
    pub cache_max_gb: Option<u64>,
    /// Registry reached over plain HTTP (repeatable).
    #[arg(long)]
    pub insecure_registry: Vec<String>,
    /// Kill every run on SIGTERM instead of leaving them for the next start.
    #[arg(long)]
    pub stop_runs_on_exit: bool,
}

/// The validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    pub listen: SocketAddr,
    pub state_dir: PathBuf,
    pub server_name: String,
    /// The deployment allowlist (`--egress-allow`, `SBX_EGRESS_ALLOW`).
    pub egress_allow: Vec<crate::egress::allowlist::Entry>,
    /// Sandbox subnet (split between the allowlist and open bridges);
    /// derived from the state dir when unset.
    pub subnet: Option<sbx_netns::ipam::Subnet>,
    /// Port range of the per-run proxies; derived when unset.
    pub proxy_ports: Option<(u16, u16)>,
    pub cache_root: Option<PathBuf>,
    pub cache_max_gb: u64,
    pub insecure_registries: Vec<String>,
    pub max_file_bytes: u64,
    pub reaper_tick_secs: u64,
    pub unpack_max_bytes: u64,
    pub unpack_max_entries: u64,
    pub stop_runs_on_exit: bool,
    /// Turn on the cgroup2 `favordynmods` flag at start (default true).
    pub cgroup_favordynmods: bool,
    pub registry_auth: BTreeMap<String, RegistryAuth>,
    pub templates: BTreeMap<String, Template>,
}

/// The default template table, as the TypeScript seed has it.
pub fn default_templates() -> BTreeMap<String, Template> {
    [
        ("base", "ubuntu:24.04"),
        ("python", "python:3.12-slim"),
        ("node", "node:22-slim"),
    ]
    .into_iter()
    .map(|(k, v)| {
        (
            k.to_string(),
            Template {
                image: v.to_string(),
                user: default_user(),
                workdir: default_workdir(),
            },
        )
    })
    .collect()
}

fn env(vars: &BTreeMap<String, String>, key: &str) -> Option<String> {
    vars.get(key).cloned()
}

fn parse_env<T: std::str::FromStr>(
    vars: &BTreeMap<String, String>,
    key: &str,
) -> Result<Option<T>, ConfigError> {
    match vars.get(key) {
        None => Ok(None),
        Some(v) => v
            .parse::<T>()
            .map(Some)
            .map_err(|_| invalid(key, format!("cannot parse {v:?}"))),
    }
}

impl Config {
    /// Loads file → env → flags. `vars` is the process environment.
    pub fn load(
        flags: &ServeFlags,
        vars: &BTreeMap<String, String>,
    ) -> Result<Config, ConfigError> {
        let path = flags
            .config
            .clone()
            .or_else(|| env(vars, "SBX_CONFIG").map(PathBuf::from))
            .unwrap_or_else(|| PathBuf::from("/etc/sbx/config.toml"));
        let explicit = flags.config.is_some() || vars.contains_key("SBX_CONFIG");
        let file = match std::fs::read_to_string(&path) {
            Ok(text) => toml::from_str::<FileConfig>(&text).map_err(|e| ConfigError::Parse {
                path: path.clone(),
                message: e.to_string(),
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && !explicit => {
                FileConfig::default()
            }
            Err(source) => return Err(ConfigError::Read { path, source }),
        };
        Config::resolve(file, flags, vars)
    }

    pub fn resolve(
        file: FileConfig,
        flags: &ServeFlags,
        vars: &BTreeMap<String, String>,
    ) -> Result<Config, ConfigError> {
        let listen_s = flags
            .listen
            .clone()
            .or_else(|| env(vars, "SBX_LISTEN"))
            .or(file.listen)
            .unwrap_or_else(|| "127.0.0.1:7439".into());
        let listen: SocketAddr = listen_s
            .parse()
            .map_err(|_| invalid("listen", format!("{listen_s:?} is not an address:port")))?;
        let public = flags.listen_public
            || parse_env::<bool>(vars, "SBX_LISTEN_PUBLIC")?.unwrap_or(false)
            || file.listen_public.unwrap_or(false);
        if !listen.ip().is_loopback() && !public {
            return Err(invalid(
                "listen",
                format!("{listen} is not loopback; pass --listen-public to expose the API"),
            ));
        }
        let state_dir = flags
            .state_dir
            .clone()
            .or_else(|| env(vars, "SBX_STATE_DIR").map(PathBuf::from))
            .or(file.state_dir)
            .unwrap_or_else(|| PathBuf::from("/var/lib/sbx"));
        if !state_dir.is_absolute() {
            return Err(invalid("state-dir", "must be an absolute path"));
        }
        let server_name = flags
            .server_name
            .clone()
            .or_else(|| env(vars, "SBX_SERVER_NAME"))
            .or(file.server_name)
            .unwrap_or_else(|| {
                nix::unistd::gethostname()
                    .ok()
                    .and_then(|h| h.into_string().ok())
                    .unwrap_or_else(|| "sbx".into())
            });
        if server_name.is_empty() || server_name.len() > 253 {
            return Err(invalid("server-name", "must be 1 to 253 characters"));
        }
        let runtime = flags
            .runtime
            .clone()
            .or_else(|| env(vars, "SBX_RUNTIME"))
            .or(file.runtime)
            .unwrap_or_else(|| "native".into());
        if runtime != "native" {
            return Err(invalid(
                "runtime",
                format!("{runtime:?} is not supported by this build yet; use \"native\""),
            ));
        }
        let egress_allow_s = flags
            .egress_allow
            .clone()
            .or_else(|| env(vars, "SBX_EGRESS_ALLOW"))
            .or(file.egress_allow)
            .unwrap_or_default();
        let egress_items: Vec<&str> = egress_allow_s
            .split([',', ' '])
            .filter(|s| !s.is_empty())
            .collect();
        let egress_allow = crate::egress::allowlist::parse_list(&egress_items)
            .map_err(|e| invalid("egress-allow", format!("malformed entry {e}")))?;
        let subnet_s = flags
            .subnet
            .clone()
            .or_else(|| env(vars, "SBX_SUBNET"))
            .or(file.subnet);
        let subnet = match subnet_s {
            Some(s) => Some(
                sbx_netns::ipam::Subnet::parse(&s).map_err(|e| invalid("subnet", e.to_string()))?,
            ),
            None => None,
        };
        if let Some(s) = subnet {
            if s.prefix > 24 {
                return Err(invalid(
                    "subnet",
                    "at most /24 (it is split between the two bridges)",
                ));
            }
        }
        let proxy_ports = match env(vars, "SBX_PROXY_PORTS").or(file.proxy_ports) {
            Some(p) => {
                let bad = || {
                    invalid(
                        "proxy-ports",
                        format!("{p:?} is not LOW-HIGH (1024..65535)"),
                    )
                };
                let (lo, hi) = p.split_once('-').ok_or_else(bad)?;
                let (lo, hi): (u16, u16) = (
                    lo.parse().map_err(|_| bad())?,
                    hi.parse().map_err(|_| bad())?,
                );
                if lo < 1024 || hi < lo {
                    return Err(bad());
                }
                Some((lo, hi))
            }
            None => None,
        };
        let cache_root = flags
            .cache_root
            .clone()
            .or_else(|| env(vars, "SBX_CACHE_ROOT").map(PathBuf::from))
            .or(file.cache_root);
        let cache_max_gb = flags
            .cache_max_gb
            .or(parse_env(vars, "SBX_CACHE_MAX_GB")?)
            .or(file.cache_max_gb)
            .unwrap_or(20);
        let mut insecure = flags.insecure_registry.clone();
        if let Some(v) = env(vars, "SBX_INSECURE_REGISTRY") {
            insecure.extend(v.split(',').filter(|s| !s.is_empty()).map(str::to_string));
        }
        insecure.extend(file.insecure_registry.unwrap_or_default());
        for r in &insecure {
            if r.is_empty() || r.contains('/') {
                return Err(invalid(
                    "insecure-registry",
                    format!("{r:?} is not HOST[:PORT]"),
                ));
            }
        }
        let max_file_mb = parse_env(vars, "SBX_MAX_FILE_MB")?
            .or(file.max_file_mb)
            .unwrap_or(64);
        if max_file_mb == 0 {
            return Err(invalid("max-file-mb", "must be at least 1"));
        }
        let reaper_tick_secs = parse_env(vars, "SBX_REAPER_TICK_SECS")?
            .or(file.reaper_tick_secs)
            .unwrap_or(5);
        if !(1..=5).contains(&reaper_tick_secs) {
            return Err(invalid("reaper-tick-secs", "must be between 1 and 5"));
        }
        let unpack_max_mb = parse_env(vars, "SBX_UNPACK_MAX_MB")?
            .or(file.unpack_max_mb)
            .unwrap_or(16 * 1024);
        let unpack_max_entries = parse_env(vars, "SBX_UNPACK_MAX_ENTRIES")?
            .or(file.unpack_max_entries)
            .unwrap_or(1_000_000);
        let stop_runs_on_exit = flags.stop_runs_on_exit
            || parse_env::<bool>(vars, "SBX_STOP_RUNS_ON_EXIT")?.unwrap_or(false)
            || file.stop_runs_on_exit.unwrap_or(false);
        let cgroup_favordynmods = parse_env::<bool>(vars, "SBX_CGROUP_FAVORDYNMODS")?
            .or(file.cgroup_favordynmods)
            .unwrap_or(true);
        let mut templates = default_templates();
        if let Some(t) = file.templates {
            templates = t;
        }
        for (name, t) in &templates {
            crate::runs::parse_user(&t.user)
                .map_err(|reason| invalid(&format!("templates.{name}.user"), reason))?;
            if !t.workdir.starts_with('/') {
                return Err(invalid(
                    &format!("templates.{name}.workdir"),
                    "must be absolute",
                ));
            }
        }
        Ok(Config {
            listen,
            state_dir,
            server_name,
            egress_allow,
            subnet,
            proxy_ports,
            cache_root,
            cache_max_gb,
            insecure_registries: insecure,
            max_file_bytes: max_file_mb << 20,
            reaper_tick_secs,
            unpack_max_bytes: unpack_max_mb << 20,
            unpack_max_entries,
            stop_runs_on_exit,
            cgroup_favordynmods,
            registry_auth: file.registry_auth.unwrap_or_default(),
            templates,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(kv: &[(&str, &str)]) -> BTreeMap<String, String> {
        kv.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn flags_override_env_override_file() {
        let file: FileConfig =
            toml::from_str("listen = \"127.0.0.1:1\"\nserver-name = \"file\"").expect("toml");
        let flags = ServeFlags {
            server_name: Some("flag".into()),
            ..Default::default()
        };
        let c =
            Config::resolve(file, &flags, &vars(&[("SBX_LISTEN", "127.0.0.1:2")])).expect("config");
        assert_eq!(c.listen.port(), 2);
        assert_eq!(c.server_name, "flag");
        assert_eq!(c.templates["python"].image, "python:3.12-slim");
        assert_eq!(c.max_file_bytes, 64 << 20);
    }

    #[test]
    fn refuses_public_listen_without_the_flag() {
        let err = Config::resolve(
            FileConfig::default(),
            &ServeFlags::default(),
            &vars(&[("SBX_LISTEN", "0.0.0.0:7439")]),
        )
        .expect_err("must refuse");
        assert!(err.to_string().starts_with("listen:"), "{err}");
    }

    #[test]
    fn malformed_values_name_the_key() {
        let err = Config::resolve(
            FileConfig::default(),
            &ServeFlags::default(),
            &vars(&[("SBX_REAPER_TICK_SECS", "x")]),
        )
        .expect_err("must refuse");
        assert_eq!(err.to_string(), "SBX_REAPER_TICK_SECS: cannot parse \"x\"");
        let err = toml::from_str::<FileConfig>("bogus = 1").expect_err("unknown key");
        assert!(err.to_string().contains("bogus"));
    }

    #[test]
    fn a_malformed_deployment_allowlist_refuses_to_start_naming_the_entry() {
        let err = Config::resolve(
            FileConfig::default(),
            &ServeFlags::default(),
            &vars(&[("SBX_EGRESS_ALLOW", "ok.example.com,.com")]),
        )
        .expect_err("must refuse");
        assert!(
            err.to_string()
                .starts_with("egress-allow: malformed entry \".com\""),
            "{err}"
        );
        let c = Config::resolve(
            FileConfig::default(),
            &ServeFlags::default(),
            &vars(&[("SBX_EGRESS_ALLOW", "a.example.com, b.example.com:8443")]),
        )
        .expect("valid");
        assert_eq!(c.egress_allow.len(), 2);
        let err = Config::resolve(
            FileConfig::default(),
            &ServeFlags::default(),
            &vars(&[("SBX_SUBNET", "10.0.0.0/27")]),
        )
        .expect_err("small");
        assert!(err.to_string().starts_with("subnet:"), "{err}");
    }

    #[test]
    fn template_users_are_validated() {
        let file: FileConfig =
            toml::from_str("[templates.x]\nimage = \"a:b\"\nuser = \"bob\"").expect("toml");
        let err =
            Config::resolve(file, &ServeFlags::default(), &BTreeMap::new()).expect_err("bad user");
        assert!(err.to_string().starts_with("templates.x.user:"), "{err}");
    }
}
