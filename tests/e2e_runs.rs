//! End-to-end: a real daemon, real namespaces and cgroups, the `host` image.
//! Root only (see `common::require_root`).

mod common;

use std::time::Duration;

use common::{require_root, wait_for, Daemon};
use reqwest::Method;
use serde_json::json;

#[test]
fn run_lifecycle_isolation_and_cleanup() {
    if !require_root("run_lifecycle_isolation_and_cleanup") {
        return;
    }
    let d = Daemon::start(&[]);
    let (s, v) = d.call(
        Method::POST,
        "/v1/runs",
        Some(json!({"labels": {"team": "a"}, "limits": {"cpu": 0.5, "memoryMb": 128, "pids": 64}})),
    );
    assert_eq!(s, 201, "{v}");
    assert_eq!(v["status"], "running");
    assert_eq!(v["server"], "e2e");
    let id = v["id"].as_str().expect("id").to_string();
    assert_eq!(id.len(), 26, "ULID");

    let out = d.sh(&id, "id -u; id -g; hostname; pwd; echo $HOME");
    assert_eq!(out["stdout"], format!("1000\n1000\n{id}\n/work\n/work\n"));
    // No capabilities, no_new_privs, seccomp filtering, in every exec.
    let out = d.sh(
        &id,
        "grep -E '^(CapEff|CapBnd|CapPrm|NoNewPrivs|Seccomp):' /proc/self/status",
    );
    let status = out["stdout"].as_str().expect("stdout");
    assert!(status.contains("CapEff:\t0000000000000000"), "{status}");
    assert!(status.contains("CapBnd:\t0000000000000000"), "{status}");
    assert!(status.contains("NoNewPrivs:\t1"), "{status}");
    assert!(status.contains("Seccomp:\t2"), "{status}");
    // No signal starts ignored, in an exec or in PID 1, however the daemon
    // was started (the tests start it from a process that ignores SIGPIPE).
    let out = d.sh(&id, "grep SigIgn: /proc/self/status /proc/1/status");
    assert_eq!(
        out["stdout"],
        "/proc/self/status:SigIgn:\t0000000000000000\n/proc/1/status:SigIgn:\t0000000000000000\n",
        "{out}"
    );
    // PID 1 installs the same filter itself before anything else.
    let out = d.sh(
        &id,
        "grep -E '^(Seccomp|NoNewPrivs|CapEff):' /proc/1/status",
    );
    assert_eq!(
        out["stdout"], "CapEff:\t0000000000000000\nNoNewPrivs:\t1\nSeccomp:\t2\n",
        "{out}"
    );
    // The command holds its three stdio descriptors and nothing of the
    // shim's or the daemon's; 3 is the directory the glob is reading.
    let out = d.sh(&id, "cd /proc/self/fd && echo *");
    assert_eq!(out["stdout"], "0 1 2 3\n", "{out}");
    // Own pid namespace with the sbx init as PID 1; only loopback.
    let out = d.sh(
        &id,
        "tr '\\0' '\\n' < /proc/1/cmdline | head -n 2 | tr '\\n' ' '; echo; ls /sys/class/net",
    );
    assert_eq!(out["stdout"], "/.sbx/init --seccomp \nlo\n");
    // No cgroup filesystem in the run, and the init binary is read-only.
    let out = d.sh(
        &id,
        "ls /sys/fs/cgroup 2>&1 | wc -w; echo x >> /.sbx/init; echo $?",
    );
    let text = out["stdout"].as_str().expect("stdout");
    assert!(text.starts_with("0\n"), "cgroupfs visible: {text}");
    assert!(!text.ends_with("\n0\n"), "init binary writable: {text}");
    // Loopback is up (a later create takes a namespace made ahead of time;
    // so does this one's second run below), and no pin outlives the create:
    // the run's processes alone hold their network namespace.
    let runs: Vec<String> = vec![id.clone(), d.create(json!({}))];
    for r in &runs {
        let out = d.sh(r, "cat /sys/class/net/lo/flags; ls /sys/class/net");
        assert_eq!(out["stdout"], "0x9\nlo\n", "{out}");
        let shim = d.shim_state(r);
        let init = shim["init_pid"].as_i64().expect("init pid");
        let ns = std::fs::metadata(format!("/proc/{init}/ns/net")).expect("netns");
        // The pin is dropped in the background once the create answered.
        wait_for("the run's network namespace unpinned", 5, || {
            let pinned: Vec<std::fs::Metadata> = std::fs::read_dir(d.state.join("netns"))
                .map(|rd| rd.flatten().filter_map(|e| e.metadata().ok()).collect())
                .unwrap_or_default();
            !pinned.iter().any(|m| {
                std::os::unix::fs::MetadataExt::ino(m) == std::os::unix::fs::MetadataExt::ino(&ns)
            })
        });
    }
    d.call(Method::DELETE, &format!("/v1/runs/{}", runs[1]), None);
    // Namespace creation and mounts are refused by seccomp.
    let out = d.sh(&id, "unshare -r true 2>&1; echo rc=$?");
    assert!(
        out["stdout"].as_str().expect("stdout").contains("rc=1"),
        "{out}"
    );
    // The generated /etc holds nothing of the host's.
    let out = d.sh(&id, "ls /etc | tr '\\n' ' '");
    assert_eq!(
        out["stdout"],
        "group hosts nsswitch.conf passwd resolv.conf "
    );

    // Limits reached the cgroup (v1 on hybrid hosts, v2 otherwise).
    let parent = d.cgroup_parent();
    let v1_mem = std::path::Path::new("/sys/fs/cgroup/memory")
        .join(&parent)
        .join(&id);
    if v1_mem.exists() {
        let read = |p: &str| {
            std::fs::read_to_string(
                std::path::Path::new("/sys/fs/cgroup")
                    .join(p)
                    .join(&parent)
                    .join(&id)
                    .join(p.split('/').next_back().unwrap_or(p)),
            )
            .unwrap_or_default()
        };
        let mem = std::fs::read_to_string(v1_mem.join("memory.limit_in_bytes")).expect("mem");
        assert_eq!(mem.trim(), (128u64 << 20).to_string());
        let pids = std::fs::read_to_string(
            std::path::Path::new("/sys/fs/cgroup/pids")
                .join(&parent)
                .join(&id)
                .join("pids.max"),
        )
        .expect("pids");
        assert_eq!(pids.trim(), "64");
        let quota = std::fs::read_to_string(
            std::path::Path::new("/sys/fs/cgroup/cpu")
                .join(&parent)
                .join(&id)
                .join("cpu.cfs_quota_us"),
        )
        .expect("quota");
        assert_eq!(quota.trim(), "50000");
        let _ = read;
    } else {
        let base = std::path::Path::new("/sys/fs/cgroup")
            .join(&parent)
            .join(&id);
        assert_eq!(
            std::fs::read_to_string(base.join("memory.max"))
                .expect("mem")
                .trim(),
            (128u64 << 20).to_string()
        );
        assert_eq!(
            std::fs::read_to_string(base.join("pids.max"))
                .expect("pids")
                .trim(),
            "64"
        );
    }

    // List and filters.
    let (_, v) = d.call(Method::GET, "/v1/runs?label=team=a", None);
    assert_eq!(v["runs"].as_array().expect("runs").len(), 1);
    let (_, v) = d.call(Method::GET, "/v1/runs?label=team=b", None);
    assert_eq!(v["runs"].as_array().expect("runs").len(), 0);
    let (s, v) = d.call(Method::GET, "/v1/runs?status=bogus", None);
    assert_eq!((s, v["error"].as_str()), (400, Some("bad_request")));

    // TTL extension.
    let (s, v) = d.call(
        Method::PATCH,
        &format!("/v1/runs/{id}"),
        Some(json!({"ttlSec": 7200})),
    );
    assert_eq!(s, 200, "{v}");

    // Leave a daemonized process behind, then delete: nothing may remain.
    d.sh(&id, "setsid sleep 1000 >/dev/null 2>&1 < /dev/null &");
    let (s, v) = d.call(Method::DELETE, &format!("/v1/runs/{id}"), None);
    assert_eq!((s, v["status"].as_str()), (200, Some("killed")), "{v}");
    assert_eq!(d.leftovers(&id), Vec::<String>::new());
    let (s, v) = d.call(
        Method::POST,
        &format!("/v1/runs/{id}/exec"),
        Some(json!({"cmd": "true"})),
    );
    assert_eq!(s, 409, "{v}");
    let (s, _) = d.call(Method::DELETE, &format!("/v1/runs/{id}?purge=true"), None);
    assert_eq!(s, 204);
    wait_for("purged record", 5, || {
        d.call(Method::GET, &format!("/v1/runs/{id}"), None).0 == 404
    });
}

#[test]
fn exec_contract() {
    if !require_root("exec_contract") {
        return;
    }
    let d = Daemon::start(&[]);
    let id = d.create(json!({"env": {"FROM_CREATE": "c1", "BOTH": "create"}}));
    // Exit codes, stdout/stderr, stdin, env layering, argv form, cwd.
    let v = d.exec(&id, json!({"cmd": "echo out; echo err >&2; exit 7"}));
    assert_eq!(
        (
            v["stdout"].as_str(),
            v["stderr"].as_str(),
            v["exitCode"].as_i64()
        ),
        (Some("out\n"), Some("err\n"), Some(7))
    );
    assert_eq!(v["timedOut"], false);
    let v = d.exec(&id, json!({"cmd": "cat", "stdin": "piped in"}));
    assert_eq!(v["stdout"], "piped in");
    let v = d.exec(&id, json!({"cmd": "echo $FROM_CREATE $BOTH $FROM_EXEC", "env": {"BOTH": "exec", "FROM_EXEC": "e1"}}));
    assert_eq!(v["stdout"], "c1 exec e1\n");
    let v = d.exec(&id, json!({"cmd": ["printf", "%s|", "a b", "$HOME"]}));
    assert_eq!(v["stdout"], "a b|$HOME|");
    let v = d.exec(&id, json!({"cmd": "pwd", "cwd": "/tmp"}));
    assert_eq!(v["stdout"], "/tmp\n");
    let v = d.exec(&id, json!({"cmd": ["no-such-binary"]}));
    assert_eq!(v["exitCode"], 127);
    // Env values never reach the host's process list or the run's JSON.
    let v = d.exec(
        &id,
        json!({"cmd": "sleep 1", "env": {"TOPSECRET": "zz-value-zz"}}),
    );
    assert_eq!(v["exitCode"], 0);
    let (_, run) = d.call(Method::GET, &format!("/v1/runs/{id}"), None);
    assert!(!run.to_string().contains("c1"), "{run}");
    assert_eq!(run["env"], json!(["BOTH", "FROM_CREATE"]));
    // Binary output is base64, never mangled.
    let v = d.exec(&id, json!({"cmd": "printf '\\377\\000\\001'"}));
    assert_eq!(
        (v["stdout"].as_str(), v["stdoutEncoding"].as_str()),
        (Some("/wAB"), Some("base64"))
    );
    // The buffered form caps each stream at 1 MiB; SSE delivers it whole.
    let v = d.exec(
        &id,
        json!({"cmd": "head -c 1500000 /dev/zero | tr '\\0' a"}),
    );
    assert_eq!(
        (v["truncated"].as_bool(), v["stdout"].as_str().map(str::len)),
        (Some(true), Some(1 << 20))
    );
    let sse = d
        .req(Method::POST, &format!("/v1/runs/{id}/exec"))
        .json(&json!({"cmd": "head -c 1500000 /dev/zero | tr '\\0' a; echo; echo done >&2"}))
        .send()
        .expect("sse")
        .text()
        .expect("text");
    let mut total = 0;
    let mut event = "";
    let mut saw_exit = false;
    for line in sse.lines() {
        if let Some(e) = line.strip_prefix("event: ") {
            event = e;
        } else if let Some(data) = line.strip_prefix("data: ") {
            let v: serde_json::Value = serde_json::from_str(data).expect("event json");
            match event {
                "stdout" => total += v["data"].as_str().expect("data").len(),
                "exit" => {
                    saw_exit = true;
                    assert_eq!(v["exitCode"], 0);
                }
                _ => {}
            }
        }
    }
    assert!(saw_exit);
    assert_eq!(total, 1_500_001);
    // A background process holding the pipe does not hold the exec.
    let v = d.exec(&id, json!({"cmd": "sleep 30 & echo bg"}));
    assert_eq!(
        (v["stdout"].as_str(), v["exitCode"].as_i64()),
        (Some("bg\n"), Some(0))
    );
    assert!(v["durationMs"].as_u64().expect("ms") < 10_000);
    // Bad input: 400 naming the field.
    for (body, needle) in [
        (json!({"cmd": "true", "bogus": 1}), "bogus"),
        (json!({"cmd": "true", "timeoutSec": 601}), "timeoutSec"),
        (json!({"cmd": "true", "env": {"A-B": "x"}}), "env.A-B"),
        (json!({"cmd": ""}), "cmd"),
        (json!({}), "cmd"),
    ] {
        let (s, v) = d.call(
            Method::POST,
            &format!("/v1/runs/{id}/exec"),
            Some(body.clone()),
        );
        assert_eq!(s, 400, "{body} → {v}");
        assert!(
            v["message"].as_str().expect("message").contains(needle),
            "{body} → {v}"
        );
    }
    // A run whose shim serves no exec socket (started by an older sbx, or
    // its shim gone) still runs commands, through the spawned helper, with
    // the same contract.
    let sock = d.state.join("runs").join(&id).join("exec.sock");
    assert!(sock.exists(), "the shim serves execs on {}", sock.display());
    std::fs::remove_file(&sock).expect("remove exec socket");
    let v = d.exec(
        &id,
        json!({"cmd": "cat; echo $FROM_CREATE >&2; exit 3", "stdin": "in\n"}),
    );
    assert_eq!(
        (
            v["stdout"].as_str(),
            v["stderr"].as_str(),
            v["exitCode"].as_i64()
        ),
        (Some("in\n"), Some("c1\n"), Some(3)),
        "{v}"
    );
    let v = d.exec(&id, json!({"cmd": "grep Seccomp: /proc/self/status"}));
    assert_eq!(v["stdout"], "Seccomp:\t2\n", "{v}");
    // A dead shim zygote is replaced at the next create.
    for pid in zygotes(&d) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
    wait_for("zygote killed", 5, || zygotes(&d).is_empty());
    let again = d.create(json!({}));
    assert_eq!(d.sh(&again, "echo ok")["stdout"], "ok\n");
    assert_eq!(zygotes(&d).len(), 1, "one new zygote");
}

/// Prints, for the run's exec standby (`sbx-exec`, waited for up to ~2 s:
/// the next one is forked while this exec runs), its cmdline, owner and
/// whether this exec's user could SIGKILL it.
const STANDBY_PROBE: &str = r#"for i in $(seq 40); do
  for p in /proc/[0-9]*; do
    if [ "$(cat $p/comm 2>/dev/null)" = sbx-exec ]; then
      tr -d '\0' < $p/cmdline; echo; stat -c %U $p
      if kill -9 ${p#/proc/} 2>/dev/null; then echo killed; else echo refused; fi
      exit 0
    fi
  done
  sleep 0.05
done
echo none"#;

#[test]
fn exec_standby_is_confined_and_expendable() {
    if !require_root("exec_standby_is_confined_and_expendable") {
        return;
    }
    let d = Daemon::start(&[]);
    // The run's user sees the standby but cannot signal it, and its
    // cmdline names nothing of the host's.
    let id = d.create(json!({}));
    assert_eq!(d.sh(&id, "true")["exitCode"], 0);
    let out = d.sh(&id, STANDBY_PROBE);
    assert_eq!(out["stdout"], "sbx-exec\nroot\nrefused\n", "{out}");
    // One standby serves exec after exec: the commands are its children's
    // (vspawn), not itself, and they are the shim's children, as the run's
    // init is.
    let standby_pid =
        "for p in /proc/[0-9]*; do [ \"$(cat $p/comm)\" = sbx-exec ] && echo ${p#/proc/}; done";
    let first = d.sh(&id, standby_pid)["stdout"].clone();
    assert!(first.as_str().is_some_and(|s| !s.is_empty()), "{first}");
    for _ in 0..5 {
        assert_eq!(d.sh(&id, "true")["exitCode"], 0);
    }
    assert_eq!(d.sh(&id, standby_pid)["stdout"], first);
    let out = d.sh(&id, "grep PPid /proc/$$/status; grep PPid /proc/1/status");
    assert_eq!(out["stdout"], "PPid:\t0\nPPid:\t0\n", "{out}");
    // A run whose user is root can kill it: execs go on working, each one
    // as confined as before, whether a standby or a fresh fork serves it.
    let root = d.create(json!({"user": "0"}));
    for round in 0..5 {
        let out = d.sh(&root, STANDBY_PROBE);
        let text = out["stdout"].as_str().expect("stdout").to_string();
        assert!(
            text == "sbx-exec\nroot\nkilled\n" || text == "none\n",
            "round {round}: {out}"
        );
        let out = d.sh(
            &root,
            "id -u; grep -E '^(CapEff|CapBnd|NoNewPrivs|Seccomp|SigIgn):' /proc/self/status; cd /proc/self/fd && echo *",
        );
        assert_eq!(
            out["stdout"],
            "0\nSigIgn:\t0000000000000000\nCapEff:\t0000000000000000\nCapBnd:\t0000000000000000\nNoNewPrivs:\t1\nSeccomp:\t2\n0 1 2 3\n",
            "round {round}: {out}"
        );
    }
}

#[test]
fn timeout_kills_everything_the_exec_started() {
    if !require_root("timeout_kills_everything_the_exec_started") {
        return;
    }
    let d = Daemon::start(&[]);
    let id = d.create(json!({"limits": {"pids": 32}}));
    // Daemonized grandchildren, a setsid'd one among them.
    let v = d.exec(
        &id,
        json!({"cmd": "setsid sleep 500 & (sleep 600 &); sleep 700", "timeoutSec": 1}),
    );
    assert_eq!(
        (v["exitCode"].as_i64(), v["timedOut"].as_bool()),
        (Some(124), Some(true))
    );
    wait_for("sleepers gone", 10, || {
        let v = d.sh(&id, "ps -eo comm | grep -c sleep");
        v["stdout"] == "0\n"
    });
    // Exhaust the pids limit; the timeout still kills from outside.
    // bash keeps retrying a failed fork, so it is still running at the deadline.
    let v = d.exec(
        &id,
        json!({"cmd": ["bash", "-c", "while :; do sleep 100 & done"], "timeoutSec": 2}),
    );
    assert_eq!(v["exitCode"], 124, "{v}");
    wait_for("run usable again", 10, || {
        let v = d.exec(&id, json!({"cmd": ["true"]}));
        v["exitCode"] == 0
    });
    wait_for("no sleeper survives the pids-exhausted timeout", 10, || {
        d.sh(&id, "ps -eo comm | grep -c -e sleep -e bash")["stdout"] == "0\n"
    });
    // A command with no shell at all times out the same way.
    let v = d.exec(
        &id,
        json!({"cmd": ["/usr/bin/sleep", "100"], "timeoutSec": 1}),
    );
    assert_eq!(v["exitCode"], 124);
}

#[test]
fn files_are_confined_to_work() {
    if !require_root("files_are_confined_to_work") {
        return;
    }
    let d = Daemon::start(&[]);
    let id = d.create(json!({}));
    let put = |path: &str, body: &[u8]| {
        d.req(Method::PUT, &format!("/v1/runs/{id}/files/{path}"))
            .body(body.to_vec())
            .send()
            .expect("put")
    };
    let get = |path: &str| {
        d.req(Method::GET, &format!("/v1/runs/{id}/files/{path}"))
            .send()
            .expect("get")
    };
    assert_eq!(put("dir/sub/hello.txt", b"hi there").status().as_u16(), 201);
    assert_eq!(
        get("dir/sub/hello.txt").bytes().expect("bytes").as_ref(),
        b"hi there"
    );
    let v = d.sh(
        &id,
        "stat -c '%U:%G %a' dir dir/sub/hello.txt; cat dir/sub/hello.txt",
    );
    assert_eq!(v["stdout"], "sbx:sbx 755\nsbx:sbx 644\nhi there");
    let listing: serde_json::Value = get("dir/sub").json().expect("json");
    assert_eq!(listing["entries"][0]["name"], "hello.txt");
    assert_eq!(listing["entries"][0]["size"], 8);
    // Symlinks out of /work, '..', FIFOs: refused, no host file touched.
    d.sh(&id, "ln -s /etc/passwd abs; ln -s ../../../../../../etc/passwd rel; mkfifo fifo; ln -s /etc escape");
    for p in ["abs", "rel", "fifo"] {
        let r = get(p);
        assert_eq!(
            r.status().as_u16(),
            400,
            "{p}: {}",
            r.text().unwrap_or_default()
        );
    }
    let host_before = std::fs::read("/etc/hostname").unwrap_or_default();
    assert_eq!(put("escape/hostname", b"pwned").status().as_u16(), 400);
    assert_eq!(
        std::fs::read("/etc/hostname").unwrap_or_default(),
        host_before
    );
    let r = d
        .req(
            Method::GET,
            &format!("/v1/runs/{id}/files/a/%2e%2e/%2e%2e/etc/passwd"),
        )
        .send()
        .expect("get");
    assert!(matches!(r.status().as_u16(), 400 | 404), "{}", r.status());
    assert_eq!(get("missing").status().as_u16(), 404);
    // The size cap is a 413.
    let big = vec![b'x'; (64 << 20) + 1];
    assert_eq!(put("big", &big).status().as_u16(), 413);
}

#[test]
fn auth_and_errors() {
    if !require_root("auth_and_errors") {
        return;
    }
    let d = Daemon::start(&[]);
    let mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(d.state.join("token"))
            .expect("token")
            .permissions(),
    );
    assert_eq!(mode & 0o777, 0o600);
    let r = d.http.get(d.url("/health")).send().expect("health");
    let v: serde_json::Value = r.json().expect("json");
    assert_eq!(
        (v["status"].as_str(), v["server"].as_str()),
        (Some("ok"), Some("e2e"))
    );
    let r = d.http.get(d.url("/v1/runs")).send().expect("runs");
    assert_eq!(r.status().as_u16(), 401);
    let r = d
        .http
        .get(d.url("/v1/runs"))
        .bearer_auth("wrong")
        .send()
        .expect("runs");
    assert_eq!(r.status().as_u16(), 401);
    let (s, v) = d.call(Method::POST, "/v1/runs", Some(json!({"imagee": "x"})));
    assert_eq!(s, 400);
    assert!(
        v["message"].as_str().expect("msg").contains("imagee"),
        "{v}"
    );
    let (s, v) = d.call(
        Method::POST,
        "/v1/runs",
        Some(json!({"limits": {"memoryMb": 1}})),
    );
    assert_eq!(
        (
            s,
            v["message"]
                .as_str()
                .map(|m| m.starts_with("limits.memoryMb"))
        ),
        (400, Some(true))
    );
    let (s, _) = d.call(Method::GET, "/v1/runs/01ARZ3NDEKTSV4RRFFQ69G5FAV", None);
    assert_eq!(s, 404);
    let (s, v) = d.call(Method::GET, "/v1/templates", None);
    assert_eq!(s, 200);
    assert_eq!(v["templates"].as_array().expect("templates").len(), 3);
    let (s, v) = d.call(Method::GET, "/v1/openapi.json", None);
    assert_eq!((s, v["openapi"].as_str()), (200, Some("3.0.3")));
}

#[test]
fn runs_survive_kill_9_and_still_expire() {
    if !require_root("runs_survive_kill_9_and_still_expire") {
        return;
    }
    let mut d = Daemon::start(&[]);
    let id = d.create(json!({"ttlSec": 6, "env": {"KEEP": "kept-across-restart"}}));
    let long = d.create(json!({"ttlSec": 600}));
    d.sh(&long, "echo state > /work/f");
    assert!(!zygotes(&d).is_empty(), "the daemon keeps a shim zygote");
    d.kill9();
    // Its shim zygote goes with it (its socket ends); the runs' shims stay.
    wait_for("shim zygote gone", 5, || zygotes(&d).is_empty());
    // Nothing the client was told is lost; the sandboxes are still there.
    d.spawn();
    let (_, v) = d.call(Method::GET, &format!("/v1/runs/{id}"), None);
    assert_eq!(v["status"], "running", "{v}");
    assert_eq!(d.sh(&id, "echo $KEEP")["stdout"], "kept-across-restart\n");
    assert_eq!(d.sh(&long, "cat /work/f")["stdout"], "state\n");
    wait_for("TTL expiry after restart", 30, || {
        d.call(Method::GET, &format!("/v1/runs/{id}"), None).1["status"] == "expired"
    });
    d.wait_nothing_left(&id, 10);
    // The env is not stored in the clear.
    for f in ["sbx.db", "sbx.db-wal"] {
        let bytes = std::fs::read(d.state.join(f)).unwrap_or_default();
        assert!(
            !bytes.windows(19).any(|w| w == b"kept-across-restart"),
            "{f} holds the env in the clear"
        );
    }
    // SIGTERM leaves runs for the next start.
    d.sigterm();
    d.spawn();
    assert_eq!(d.sh(&long, "cat /work/f")["stdout"], "state\n");
}

/// Pids of the shim zygote of `d` (the shims forked from it carry the same
/// environment, have their run's directory as cwd and live on with the run).
fn zygotes(d: &Daemon) -> Vec<i32> {
    let want = format!("SBX_SHIM_OF={}", d.state.display());
    let runs = d.state.join("runs");
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").expect("proc").flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let env = std::fs::read(e.path().join("environ")).unwrap_or_default();
        let stat = std::fs::read_to_string(e.path().join("stat")).unwrap_or_default();
        let zombie = stat
            .rsplit(')')
            .next()
            .is_some_and(|r| r.trim_start().starts_with('Z'));
        // A shim's cwd is its run's directory; so is its exec standby's
        // until it names itself sbx-exec (and then enters the run).
        let serving = std::fs::read_link(e.path().join("cwd"))
            .is_ok_and(|c| c.parent() == Some(runs.as_path()))
            || std::fs::read_to_string(e.path().join("comm")).is_ok_and(|c| c == "sbx-exec\n");
        if !zombie && !serving && env.split(|b| *b == 0).any(|v| v == want.as_bytes()) {
            out.push(pid);
        }
    }
    out
}

#[test]
fn restart_removes_orphans_and_marks_vanished_runs() {
    if !require_root("restart_removes_orphans_and_marks_vanished_runs") {
        return;
    }
    let mut d = Daemon::start(&[]);
    let vanished = d.create(json!({}));
    let state = d.shim_state(&vanished);
    d.kill9();
    // The sandbox dies while the daemon is down.
    for k in ["init_pid", "shim_pid"] {
        let pid = state[k].as_i64().expect("pid") as i32;
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
    // And an orphan appears: a run directory and cgroup nobody owns.
    let orphan = "01ARZ3NDEKTSV4RRFFQ69G5FAV";
    std::fs::create_dir_all(d.state.join("runs").join(orphan).join("rootfs")).expect("orphan dir");
    for cg in common::cgroup_dirs(&d.cgroup_parent(), orphan) {
        if cg.parent().is_some_and(|p| p.exists()) {
            let _ = std::fs::create_dir(&cg);
        }
    }
    d.spawn();
    let (_, v) = d.call(Method::GET, &format!("/v1/runs/{vanished}"), None);
    assert_eq!(v["status"], "error", "{v}");
    assert_eq!(d.leftovers(orphan), Vec::<String>::new());
    d.wait_nothing_left(&vanished, 10);
    let _ = Duration::from_secs(0);
}

#[test]
fn stop_runs_on_exit_kills_runs() {
    if !require_root("stop_runs_on_exit_kills_runs") {
        return;
    }
    let mut d = Daemon::start(&["--stop-runs-on-exit"]);
    let id = d.create(json!({}));
    d.sigterm();
    assert_eq!(d.leftovers(&id), Vec::<String>::new());
    d.extra.clear();
    d.spawn();
    let (_, v) = d.call(Method::GET, &format!("/v1/runs/{id}"), None);
    assert_eq!(v["status"], "killed");
}
