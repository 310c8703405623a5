//! A real daemon for end-to-end tests: root, a private state dir and port.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// The local test registry (scripts/registry) and its images (scripts/build-images).
pub fn registry() -> String {
    std::env::var("SBX_REGISTRY").unwrap_or_else(|_| "127.0.0.1:5000".into())
}

/// Image tests need the registry; in CI its absence is a failure.
pub fn require_registry(name: &str) -> bool {
    if !require_root(name) {
        return false;
    }
    let up = reqwest::blocking::get(format!("http://{}/v2/", registry()))
        .is_ok_and(|r| r.status().is_success());
    if up {
        return true;
    }
    if std::env::var("SBX_REQUIRE_E2E").is_ok_and(|v| v == "1") {
        panic!(
            "{name}: no registry at {} (start scripts/registry and scripts/build-images)",
            registry()
        );
    }
    eprintln!(
        "SKIPPED {name}: no registry at {}; run scripts/registry and scripts/build-images",
        registry()
    );
    false
}

/// Privileged tests need root. In CI (`SBX_REQUIRE_E2E=1`) anything else is
/// a failure; a plain `cargo test` as a user prints why it skipped.
pub fn require_root(name: &str) -> bool {
    if nix::unistd::geteuid().is_root() {
        return true;
    }
    if std::env::var("SBX_REQUIRE_E2E").is_ok_and(|v| v == "1") {
        panic!("{name}: end-to-end tests must run as root (SBX_REQUIRE_E2E=1)");
    }
    eprintln!("SKIPPED {name}: end-to-end tests need root; run scripts/test as root");
    false
}

pub struct Daemon {
    /// Network namespace (`/run/netns/NAME`) and hosts file the daemon runs with.
    pub netns: Option<(String, PathBuf)>,
    pub child: Option<Child>,
    pub state: PathBuf,
    pub port: u16,
    pub token: String,
    pub extra: Vec<String>,
    _tmp: Option<tempfile::TempDir>,
    pub http: reqwest::blocking::Client,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

pub fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_sbx")
}

impl Daemon {
    pub fn start(extra: &[&str]) -> Daemon {
        Daemon::start_in(extra, None)
    }

    /// A daemon inside network namespace `netns` (its bridges and every
    /// address it makes stay there), with `hosts` as its /etc/hosts.
    pub fn start_in(extra: &[&str], netns: Option<(String, PathBuf)>) -> Daemon {
        let tmp = tempfile::Builder::new()
            .prefix("sbx-e2e-")
            .tempdir()
            .expect("tempdir");
        // The API listens inside the namespace: build the client on a thread
        // that entered it, so the client's own I/O thread starts there too.
        let ns = netns.as_ref().map(|(n, _)| n.clone());
        let http = std::thread::spawn(move || {
            if let Some(n) = ns {
                let f = std::fs::File::open(format!("/run/netns/{n}")).expect("netns");
                nix::sched::setns(&f, nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
            }
            reqwest::blocking::Client::builder()
                .timeout(Duration::from_secs(120))
                .build()
                .expect("client")
        })
        .join()
        .expect("client thread");
        let mut d = Daemon {
            netns,
            child: None,
            state: tmp.path().to_path_buf(),
            port: free_port(),
            token: String::new(),
            extra: extra.iter().map(|s| s.to_string()).collect(),
            _tmp: Some(tmp),
            http,
        };
        d.spawn();
        d
    }

    pub fn spawn(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.state.with_extension("log"))
            .expect("log");
        let mut cmd = match &self.netns {
            None => Command::new(bin()),
            Some((ns, hosts)) => {
                let mut c = Command::new("unshare");
                c.args(["-m", "--propagation", "private", "sh", "-c"])
                    .arg(r#"hosts=$1; ns=$2; shift 2; mount --bind "$hosts" /etc/hosts && exec nsenter --net="$ns" "$@""#)
                    .arg("sh")
                    .arg(hosts)
                    .arg(format!("/run/netns/{ns}"))
                    .arg(bin());
                c
            }
        };
        let child = cmd
            .arg("serve")
            .arg("--state-dir")
            .arg(&self.state)
            .arg("--listen")
            .arg(format!("127.0.0.1:{}", self.port))
            .arg("--server-name")
            .arg("e2e")
            .args(&self.extra)
            .env("SBX_CONFIG", "/dev/null")
            .env("SBX_REAPER_TICK_SECS", "1")
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("spawn daemon");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(r) = self.http.get(self.url("/health")).send() {
                if r.status().is_success() {
                    break;
                }
            }
            assert!(
                Instant::now() < deadline,
                "daemon did not come up; log:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        self.token = std::fs::read_to_string(self.state.join("token"))
            .expect("token")
            .trim()
            .to_string();
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.state.with_extension("log")).unwrap_or_default()
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{}", self.port, path)
    }

    pub fn req(&self, m: reqwest::Method, path: &str) -> reqwest::blocking::RequestBuilder {
        self.http
            .request(m, self.url(path))
            .bearer_auth(&self.token)
    }

    /// (status, JSON body) of a request.
    pub fn call(&self, m: reqwest::Method, path: &str, body: Option<Value>) -> (u16, Value) {
        let mut rb = self.req(m, path);
        if let Some(b) = body {
            rb = rb.json(&b);
        }
        let r = rb.send().expect("request");
        let status = r.status().as_u16();
        let text = r.text().expect("body");
        (
            status,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        )
    }

    pub fn create(&self, body: Value) -> String {
        let (s, v) = self.call(reqwest::Method::POST, "/v1/runs", Some(body));
        assert_eq!(s, 201, "create failed: {v}\n{}", self.log());
        v["id"].as_str().expect("id").to_string()
    }

    /// Buffered exec.
    pub fn exec(&self, id: &str, body: Value) -> Value {
        let r = self
            .req(reqwest::Method::POST, &format!("/v1/runs/{id}/exec"))
            .header("accept", "application/json")
            .json(&body)
            .send()
            .expect("exec");
        let status = r.status().as_u16();
        let v: Value = r.json().expect("json");
        assert_eq!(status, 200, "exec failed: {v}");
        v
    }

    pub fn sh(&self, id: &str, cmd: &str) -> Value {
        self.exec(id, json!({"cmd": cmd}))
    }

    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub fn sigterm(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(c.id() as i32),
                nix::sys::signal::Signal::SIGTERM,
            );
            let _ = c.wait();
        }
    }

    pub fn cgroup_parent(&self) -> String {
        use sha2::Digest;
        let canon = self.state.canonicalize().expect("canon");
        let h = sha2::Sha256::digest(canon.as_os_str().as_encoded_bytes());
        format!(
            "sbx-{}",
            h.iter()
                .take(4)
                .map(|b| format!("{b:02x}"))
                .collect::<String>()
        )
    }

    /// The run's shim record (`shim.json`; the shim writes it just after
    /// it reports ready, so it is waited for).
    pub fn shim_state(&self, id: &str) -> Value {
        let path = self.state.join("runs").join(id).join("shim.json");
        wait_for("shim.json", 5, || path.exists());
        serde_json::from_slice(&std::fs::read(&path).expect("shim.json")).expect("shim state")
    }

    /// Waits up to `secs` for [`Daemon::leftovers`] of `id` to be empty;
    /// names what is still there if it is not.
    pub fn wait_nothing_left(&self, id: &str, secs: u64) {
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            let left = self.leftovers(id);
            if left.is_empty() {
                return;
            }
            assert!(Instant::now() < deadline, "left of run {id}: {left:?}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Everything this daemon left on the host for run `id`.
    pub fn leftovers(&self, id: &str) -> Vec<String> {
        let mut out = Vec::new();
        let run_dir = self.state.join("runs").join(id);
        if run_dir.exists() {
            out.push(format!("dir {}", run_dir.display()));
        }
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        for l in mounts.lines().filter(|l| l.contains(id)) {
            out.push(format!("mount {l}"));
        }
        for cg in cgroup_dirs(&self.cgroup_parent(), id) {
            if cg.exists() {
                out.push(format!("cgroup {}", cg.display()));
            }
        }
        for p in procs_mentioning(id) {
            out.push(format!("process {p}"));
        }
        out
    }
}

pub fn cgroup_dirs(parent: &str, id: &str) -> Vec<PathBuf> {
    let mut v = Vec::new();
    if let Ok(rd) = std::fs::read_dir("/sys/fs/cgroup") {
        for e in rd.flatten() {
            v.push(e.path().join(parent).join(id));
        }
    }
    v.push(Path::new("/sys/fs/cgroup").join(parent).join(id));
    v
}

pub fn procs_mentioning(id: &str) -> Vec<String> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").expect("proc").flatten() {
        if e.file_name().to_string_lossy().parse::<u32>().is_err() {
            continue;
        }
        if let Ok(c) = std::fs::read(e.path().join("cmdline")) {
            let s = String::from_utf8_lossy(&c).replace('\0', " ");
            if s.contains(id) {
                out.push(format!("{} {s}", e.file_name().to_string_lossy()));
            }
        }
    }
    out
}

pub fn wait_for(what: &str, secs: u64, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !f() {
        assert!(Instant::now() < deadline, "gave up waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        // Leave nothing behind: stop the daemon with its runs.
        self.kill9();
        if !self.extra.iter().any(|a| a == "--stop-runs-on-exit") {
            self.extra.push("--stop-runs-on-exit".into());
        }
        if self.state.join("token").exists() {
            self.spawn();
            self.sigterm();
        }
        // Keep the daemon's log only when the test failed.
        if std::thread::panicking() {
            eprintln!(
                "daemon log kept at {}",
                self.state.with_extension("log").display()
            );
        } else {
            let _ = std::fs::remove_file(self.state.with_extension("log"));
        }
    }
}

pub fn json_of(v: &Value, k: &str) -> String {
    v[k].as_str().unwrap_or_default().to_string()
}
