//! Run spec → OCI runtime spec. Pure: no kernel calls, unit-tested.

use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use crate::seccomp;

/// Where the init binary appears inside every run.
pub const INIT_PATH: &str = "/.sbx/init";
/// PATH given to runs that do not bring their own.
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
pub const CPU_PERIOD_US: u64 = 100_000;

/// Validated resource limits.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Limits {
    /// CPU in thousandths of a core (1000 = one CPU).
    pub cpu_millis: u32,
    pub memory_bytes: u64,
    pub pids: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            cpu_millis: 1000,
            memory_bytes: 1024 * 1024 * 1024,
            pids: 256,
        }
    }
}

impl Limits {
    /// CFS quota for one `CPU_PERIOD_US` period.
    pub fn cpu_quota_us(&self) -> u64 {
        u64::from(self.cpu_millis) * CPU_PERIOD_US / 1000
    }
}

/// A read-only bind mount from the host into the run.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct BindMount {
    pub source: PathBuf,
    pub destination: String,
}

/// Everything needed to render a run's OCI spec.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct RunSpec {
    pub id: String,
    pub rootfs: PathBuf,
    /// Host path of the static init, bind-mounted read-only as PID 1.
    pub init_binary: PathBuf,
    pub uid: u32,
    pub gid: u32,
    pub env: Vec<String>,
    pub limits: Limits,
    /// cgroup path relative to each hierarchy root, e.g. `/sbx-ab12/01J…`.
    pub cgroups_path: String,
    /// Read-only host directories (the `host` image's `/usr`).
    pub ro_binds: Vec<BindMount>,
    /// A prepared network namespace to join (networked tiers); a fresh one
    /// with only loopback when `None`.
    #[serde(default)]
    pub netns: Option<PathBuf>,
    /// Whether the v1 memory controller accounts swap (`memory.memsw.*`).
    pub swap_accounting: bool,
    /// RLIMIT_NOFILE (soft = hard) for the run; at most the daemon's own
    /// hard limit, which it may not be able to raise.
    pub nofile: u64,
    /// The seccomp profile precompiled to BPF (`seccomp::export_bpf`). When
    /// given, the init installs it itself as its first act and the spec
    /// carries no `linux.seccomp`, which libcontainer would compile again
    /// for every run (~1 ms); otherwise libcontainer applies the OCI form.
    #[serde(default)]
    pub seccomp_bpf: Option<Vec<u8>>,
}

/// The open-files limit runs get: 65536, or the host's hard limit if lower.
pub fn nofile_limit() -> u64 {
    let hard = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
        .map(|(_, h)| h)
        .unwrap_or(1024);
    hard.min(65536)
}

/// Paths hidden from the run, as runc does.
pub const MASKED_PATHS: &[&str] = &[
    "/proc/acpi",
    "/proc/asound",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/sys/firmware",
    "/sys/devices/virtual/powercap",
];

/// Paths the run may read but not write, as runc does.
pub const READONLY_PATHS: &[&str] = &[
    "/proc/bus",
    "/proc/fs",
    "/proc/irq",
    "/proc/sys",
    "/proc/sysrq-trigger",
];

/// Character devices a run may use: null, zero, full, random, urandom,
/// tty, ptmx and the pty slaves. Everything else is denied.
const ALLOWED_CHAR_DEVICES: &[(i64, Option<i64>)] = &[
    (1, Some(3)),
    (1, Some(5)),
    (1, Some(7)),
    (1, Some(8)),
    (1, Some(9)),
    (5, Some(0)),
    (5, Some(2)),
    (136, None),
];

fn device_rules() -> Vec<Value> {
    let mut rules = vec![json!({"allow": false, "access": "rwm"})];
    for (major, minor) in ALLOWED_CHAR_DEVICES {
        let mut rule = json!({"allow": true, "type": "c", "major": major, "access": "rwm"});
        if let Some(minor) = minor {
            rule["minor"] = json!(minor);
        }
        rules.push(rule);
    }
    rules
}

fn mounts(spec: &RunSpec) -> Vec<Value> {
    let mut m = vec![
        json!({"destination": "/proc", "type": "proc", "source": "proc",
               "options": ["nosuid", "noexec", "nodev"]}),
        json!({"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
               "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]}),
        json!({"destination": "/dev/pts", "type": "devpts", "source": "devpts",
               "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]}),
        json!({"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
               "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]}),
        json!({"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue",
               "options": ["nosuid", "noexec", "nodev"]}),
        json!({"destination": "/sys", "type": "sysfs", "source": "sysfs",
               "options": ["nosuid", "noexec", "nodev", "ro"]}),
        json!({"destination": "/tmp", "type": "tmpfs", "source": "tmpfs",
               "options": ["nosuid", "nodev", "mode=1777"]}),
        json!({"destination": INIT_PATH, "type": "bind", "source": spec.init_binary,
               "options": ["bind", "ro", "nosuid", "nodev"]}),
    ];
    for b in &spec.ro_binds {
        m.push(
            json!({"destination": b.destination, "type": "bind", "source": b.source,
                      "options": ["rbind", "ro", "nosuid", "nodev"]}),
        );
    }
    m
}

/// Renders the OCI runtime spec (`config.json`) for a run.
pub fn render(spec: &RunSpec) -> Value {
    let mut env = spec.env.clone();
    if !env.iter().any(|e| e.starts_with("PATH=")) {
        env.push(format!("PATH={DEFAULT_PATH}"));
    }
    let swap = if spec.swap_accounting {
        json!(spec.limits.memory_bytes)
    } else {
        Value::Null
    };
    let network = match &spec.netns {
        Some(p) => json!({"type": "network", "path": p}),
        None => json!({"type": "network"}),
    };
    let mut memory = json!({"limit": spec.limits.memory_bytes});
    if !swap.is_null() {
        memory["swap"] = swap;
    }
    let args = match &spec.seccomp_bpf {
        Some(bpf) => {
            let hex: String = bpf.iter().map(|b| format!("{b:02x}")).collect();
            json!([INIT_PATH, "--seccomp", hex])
        }
        None => json!([INIT_PATH]),
    };
    let mut rendered = json!({
        "ociVersion": "1.0.2",
        "process": {
            "terminal": false,
            "user": {"uid": spec.uid, "gid": spec.gid, "additionalGids": [spec.gid]},
            "args": args,
            "env": env,
            "cwd": "/",
            "capabilities": {"bounding": [], "effective": [], "inheritable": [],
                             "permitted": [], "ambient": []},
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": spec.nofile, "soft": spec.nofile}],
            "noNewPrivileges": true
        },
        "root": {"path": spec.rootfs, "readonly": false},
        "hostname": spec.id,
        "mounts": mounts(spec),
        "linux": {
            "cgroupsPath": spec.cgroups_path,
            "resources": {
                "devices": device_rules(),
                "memory": memory,
                "cpu": {"quota": spec.limits.cpu_quota_us(), "period": CPU_PERIOD_US},
                "pids": {"limit": spec.limits.pids}
            },
            "namespaces": [
                {"type": "pid"}, network, {"type": "ipc"},
                {"type": "uts"}, {"type": "mount"}, {"type": "cgroup"}
            ],
            "maskedPaths": MASKED_PATHS,
            "readonlyPaths": READONLY_PATHS,
        }
    });
    if spec.seccomp_bpf.is_none() {
        rendered["linux"]["seccomp"] = seccomp::render_oci();
    }
    rendered
}

/// What the shim needs back from a bundle's rendered `config.json`.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct RenderedFacts {
    /// The run joins a ready network namespace (its loopback is up already).
    pub joins_network_namespace: bool,
    /// The seccomp program its init installs (`--seccomp`).
    pub seccomp_bpf: Option<Vec<u8>>,
    pub cgroups_path: Option<String>,
}

/// Reads [`RenderedFacts`] back from what [`render`] wrote. Pure.
pub fn rendered_facts(config: &Value) -> RenderedFacts {
    let joins_network_namespace = config["linux"]["namespaces"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|n| n["type"] == "network" && n["path"].is_string());
    let args: Vec<&str> = config["process"]["args"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    let seccomp_bpf = args
        .windows(2)
        .find(|w| w[0] == "--seccomp")
        .and_then(|w| decode_hex(w[1]));
    RenderedFacts {
        joins_network_namespace,
        seccomp_bpf,
        cgroups_path: config["linux"]["cgroupsPath"].as_str().map(str::to_string),
    }
}

fn decode_hex(hex: &str) -> Option<Vec<u8>> {
    if !hex.len().is_multiple_of(2) {
        return None;
    }
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(hex.get(i..i + 2)?, 16).ok())
        .collect()
}

/// Writes `config.json` into `bundle` atomically.
pub fn write_bundle(bundle: &Path, spec: &RunSpec) -> std::io::Result<()> {
    std::fs::create_dir_all(bundle)?;
    let body = serde_json::to_vec_pretty(&render(spec)).map_err(std::io::Error::other)?;
    let tmp = bundle.join("config.json.tmp");
    std::fs::write(&tmp, body)?;
    std::fs::rename(tmp, bundle.join("config.json"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> RunSpec {
        RunSpec {
            id: "01JTEST".into(),
            rootfs: "/var/lib/sbx/runs/01JTEST/rootfs".into(),
            init_binary: "/usr/local/bin/sbx".into(),
            uid: 1000,
            gid: 1000,
            env: vec!["HOME=/work".into()],
            limits: Limits {
                cpu_millis: 1500,
                memory_bytes: 512 << 20,
                pids: 64,
            },
            cgroups_path: "/sbx-1234/01JTEST".into(),
            ro_binds: vec![BindMount {
                source: "/usr".into(),
                destination: "/usr".into(),
            }],
            swap_accounting: true,
            nofile: 4096,
            netns: None,
            seccomp_bpf: None,
        }
    }

    #[test]
    fn a_precompiled_filter_goes_to_the_init_instead_of_libcontainer() {
        let mut s = sample();
        s.seccomp_bpf = Some(vec![0x06, 0x00, 0x00, 0x00, 0xff, 0xff, 0xff, 0x7f]);
        let v = render(&s);
        assert_eq!(
            v["process"]["args"],
            json!([INIT_PATH, "--seccomp", "06000000ffffff7f"])
        );
        assert!(v["linux"].get("seccomp").is_none());
        assert_eq!(v["process"]["noNewPrivileges"], true);
        let without = render(&sample());
        assert_eq!(without["process"]["args"], json!([INIT_PATH]));
        assert!(without["linux"]["seccomp"].is_object());
    }

    #[test]
    fn the_shim_reads_back_what_was_rendered() {
        let mut s = sample();
        let plain = rendered_facts(&render(&s));
        assert_eq!(
            plain,
            RenderedFacts {
                joins_network_namespace: false,
                seccomp_bpf: None,
                cgroups_path: Some("/sbx-1234/01JTEST".into()),
            }
        );
        s.seccomp_bpf = Some(vec![0x06, 0x00, 0x00, 0x00, 0xff, 0xff, 0xff, 0x7f]);
        s.netns = Some("/run/sbx/netns/x".into());
        let facts = rendered_facts(&render(&s));
        assert!(facts.joins_network_namespace);
        assert_eq!(facts.seccomp_bpf, s.seccomp_bpf);
        assert_eq!(decode_hex("0g"), None);
        assert_eq!(decode_hex("abc"), None);
    }

    #[test]
    fn renders_a_spec_that_oci_spec_accepts() {
        let v = render(&sample());
        let parsed: oci_spec::runtime::Spec = serde_json::from_value(v).expect("valid OCI spec");
        let linux = parsed.linux().as_ref().expect("linux section");
        let res = linux.resources().as_ref().expect("resources");
        assert_eq!(res.cpu().as_ref().and_then(|c| c.quota()), Some(150_000));
        assert_eq!(
            res.memory().as_ref().and_then(|m| m.limit()),
            Some(512 << 20)
        );
        assert_eq!(
            res.memory().as_ref().and_then(|m| m.swap()),
            Some(512 << 20)
        );
        assert_eq!(res.pids().as_ref().map(|p| p.limit()), Some(64));
        assert_eq!(parsed.hostname().as_deref(), Some("01JTEST"));
        let nss: Vec<String> = linux
            .namespaces()
            .as_ref()
            .expect("namespaces")
            .iter()
            .map(|n| format!("{:?}", n.typ()))
            .collect();
        assert_eq!(nss.len(), 6);
        assert!(linux.seccomp().is_some());
    }

    #[test]
    fn drops_every_capability_and_sets_no_new_privileges() {
        let v = render(&sample());
        for set in [
            "bounding",
            "effective",
            "inheritable",
            "permitted",
            "ambient",
        ] {
            assert_eq!(v["process"]["capabilities"][set], json!([]), "{set}");
        }
        assert_eq!(v["process"]["noNewPrivileges"], json!(true));
        assert_eq!(v["process"]["user"]["uid"], json!(1000));
    }

    #[test]
    fn device_cgroup_starts_with_deny_all() {
        let v = render(&sample());
        let devs = v["linux"]["resources"]["devices"]
            .as_array()
            .expect("devices");
        assert_eq!(devs[0], json!({"allow": false, "access": "rwm"}));
        assert!(devs[1..]
            .iter()
            .all(|d| d["allow"] == json!(true) && d["type"] == "c"));
    }

    #[test]
    fn never_mounts_the_cgroup_filesystem() {
        let v = render(&sample());
        let mounts = v["mounts"].as_array().expect("mounts");
        assert!(mounts
            .iter()
            .all(|m| m["type"] != "cgroup" && m["type"] != "cgroup2"));
        let init = mounts
            .iter()
            .find(|m| m["destination"] == INIT_PATH)
            .expect("init mount");
        assert!(init["options"]
            .as_array()
            .expect("opts")
            .contains(&json!("ro")));
    }

    #[test]
    fn joins_a_prepared_network_namespace() {
        let mut s = sample();
        s.netns = Some("/var/lib/sbx/netns/abc".into());
        let v = render(&s);
        let nss = v["linux"]["namespaces"].as_array().expect("namespaces");
        assert!(nss.contains(&json!({"type": "network", "path": "/var/lib/sbx/netns/abc"})));
    }

    #[test]
    fn omits_swap_without_accounting() {
        let mut s = sample();
        s.swap_accounting = false;
        let v = render(&s);
        assert!(v["linux"]["resources"]["memory"].get("swap").is_none());
        assert_eq!(
            v["process"]["env"][1],
            json!(format!("PATH={DEFAULT_PATH}"))
        );
    }

    #[test]
    fn fractional_cpu_becomes_quota() {
        let l = Limits {
            cpu_millis: 100,
            ..Limits::default()
        };
        assert_eq!(l.cpu_quota_us(), 10_000);
    }
}
