//! End-to-end: the none, allowlist and open tiers. The daemon runs inside a
//! network namespace made for the test; the "internet" is another namespace
//! with its own servers (tests/fixtures/internet.py). Nothing here sends a
//! packet to an address outside this machine.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use common::{require_root, wait_for, Daemon};
use reqwest::Method;
use serde_json::{json, Value};

fn sh(cmd: &str) -> String {
    let out = Command::new("sh").arg("-c").arg(cmd).output().expect("sh");
    assert!(
        out.status.success(),
        "{cmd}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn sh_ok(cmd: &str) -> String {
    let out = Command::new("sh").arg("-c").arg(cmd).output().expect("sh");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Two namespaces (daemon, internet), a veth between them, the servers.
struct World {
    d: String,
    i: String,
    dir: tempfile::TempDir,
    servers: Option<Child>,
}

impl World {
    fn new(tag: &str) -> World {
        let pid = std::process::id();
        let (d, i) = (format!("sbxt{pid}{tag}d"), format!("sbxt{pid}{tag}i"));
        let dir = tempfile::tempdir().expect("tmp");
        let mut w = World {
            d,
            i,
            dir,
            servers: None,
        };
        let (d, i) = (&w.d, &w.i);
        sh(&format!(
            "ip netns add {d} && ip netns add {i} && ip -n {d} link set lo up && ip -n {i} link set lo up && \
             ip link add up{pid}{tag} netns {d} type veth peer name eth0 netns {i} && \
             ip -n {d} addr add 203.0.113.1/24 dev up{pid}{tag} && ip -n {d} link set up{pid}{tag} up && \
             ip -n {i} addr add 203.0.113.2/24 dev eth0 && ip -n {i} link set eth0 up && \
             for a in 10 11 12; do ip -n {i} addr add 203.0.113.$a/24 dev eth0; done"
        ));
        let p = w.dir.path();
        std::fs::write(
            p.join("hosts"),
            "127.0.0.1 localhost\n203.0.113.10 allowed.test www.allowed.test\n203.0.113.11 denied.test\n\
             203.0.113.12 forge.test\n10.20.30.40 private.test\n203.0.113.1 daemon.test\n",
        )
        .expect("hosts");
        // A test CA and a certificate for allowed.test.
        let q = p.display();
        sh(&format!(
            "cd {q} && openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=sbx-test-ca -keyout ca.key -out ca.pem 2>/dev/null && \
             openssl req -newkey rsa:2048 -nodes -subj /CN=allowed.test -keyout srv.key -out srv.csr 2>/dev/null && \
             printf 'subjectAltName=DNS:allowed.test,DNS:www.allowed.test' > ext && \
             openssl x509 -req -in srv.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 -extfile ext -out srv.pem 2>/dev/null"
        ));
        // A dumb-HTTP git repository and a page, served over HTTPS.
        sh(&format!(
            "cd {q} && mkdir -p www && echo 'hello from allowed.test' > www/index.html && \
             git init -q --bare www/repo.git && git init -q src && cd src && \
             echo 'cloned through the proxy' > README && git add README && \
             git -c user.email=t@t -c user.name=t commit -q -m init && \
             git push -q ../www/repo.git HEAD:refs/heads/main && cd ../www/repo.git && \
             git symbolic-ref HEAD refs/heads/main && git update-server-info"
        ));
        let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/internet.py");
        let mut child = Command::new("ip")
            .args(["netns", "exec", i, "python3"])
            .arg(&fixture)
            .arg(p.join("www"))
            .arg(p.join("srv.pem"))
            .arg(p.join("srv.key"))
            .stdout(Stdio::piped())
            .spawn()
            .expect("servers");
        let mut line = String::new();
        use std::io::BufRead;
        std::io::BufReader::new(child.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("ready");
        assert_eq!(line.trim(), "ready");
        w.servers = Some(child);
        w
    }

    fn daemon(&self, extra: &[&str]) -> Daemon {
        Daemon::start_in(extra, Some((self.d.clone(), self.dir.path().join("hosts"))))
    }

    fn ca(&self) -> PathBuf {
        self.dir.path().join("ca.pem")
    }

    /// What is left in the daemon's namespace of run `id` (described by its
    /// JSON before deletion): its link, its anti-spoofing table, its proxy.
    fn run_leftovers(&self, run: &Value) -> Vec<String> {
        let link = run["link"].as_str().expect("link").to_string();
        let slot = link.trim_start_matches("vsbx").to_string();
        let mut out: Vec<String> = self
            .leftovers_all()
            .into_iter()
            .filter(|l| l.contains(&link) || l.contains(&format!("-{slot}")))
            .collect();
        if let Some(proxy) = run["proxy"].as_str() {
            let port = format!(":{}", proxy.rsplit(':').next().unwrap_or(""));
            out.extend(self.listeners().into_iter().filter(|l| l.contains(&port)));
        }
        out
    }

    /// Hardware addresses of the daemon's bridges, by name.
    fn bridge_macs(&self) -> Vec<String> {
        sh_ok(&format!("ip -n {} -br link show type bridge", self.d))
            .lines()
            .filter(|l| l.starts_with("sbx"))
            .map(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                format!("{} {}", f[0], f.get(2).unwrap_or(&""))
            })
            .collect()
    }

    fn listeners(&self) -> Vec<String> {
        sh_ok(&format!("ip netns exec {} ss -Hltn", self.d))
            .lines()
            .map(str::to_string)
            .collect()
    }

    /// Every sbx link, table, pinned namespace and non-API listener.
    fn leftovers_all(&self) -> Vec<String> {
        let mut out = Vec::new();
        for l in sh_ok(&format!("ip -n {} -br link", self.d)).lines() {
            if l.contains("sbx") {
                out.push(format!("link {l}"));
            }
        }
        for t in sh_ok(&format!("ip netns exec {} nft list tables", self.d)).lines() {
            if t.contains("sbx") {
                out.push(format!("table {t}"));
            }
        }
        out
    }

    /// Stops the daemon with its runs and checks the namespace holds
    /// nothing of sbx any more: no link, bridge, table or listener.
    fn assert_clean_after_stop(&self, d: &mut Daemon) {
        d.kill9();
        if !d.extra.iter().any(|a| a == "--stop-runs-on-exit") {
            d.extra.push("--stop-runs-on-exit".into());
        }
        d.spawn();
        d.sigterm();
        assert_eq!(self.leftovers_all(), Vec::<String>::new());
        assert_eq!(self.listeners(), Vec::<String>::new());
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        assert!(
            !mounts.contains(&d.state.join("netns").display().to_string()),
            "pinned namespaces left"
        );
    }
}

impl Drop for World {
    fn drop(&mut self) {
        if let Some(mut c) = self.servers.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = Command::new("ip").args(["netns", "del", &self.d]).status();
        let _ = Command::new("ip").args(["netns", "del", &self.i]).status();
    }
}

fn out(v: &Value) -> String {
    format!(
        "{}{}",
        v["stdout"].as_str().unwrap_or(""),
        v["stderr"].as_str().unwrap_or("")
    )
}

/// A CONNECT sent by hand to the run's proxy: the status line.
fn connect_cmd(target: &str) -> String {
    format!(
        "python3 -c \"import os,socket; h,p=os.environ['HTTP_PROXY'][7:].split(':'); s=socket.create_connection((h,int(p)),5); \
         s.sendall(b'CONNECT {target} HTTP/1.1\\r\\nHost: {target}\\r\\n\\r\\n'); print(s.recv(4096).split(b'\\r\\n')[0].decode())\""
    )
}

/// One ICMP echo through an unprivileged datagram socket: prints ok or the error.
fn ping_cmd(host: &str) -> String {
    format!(
        "python3 -c \"import socket; s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP); s.settimeout(2); \
         s.sendto(b'\\x08\\x00\\x00\\x00\\x00\\x01\\x00\\x01ping', ('{host}', 0)); s.recvfrom(64); print('ok')\" 2>&1 | tail -1"
    )
}

fn tcp_cmd(host: &str, port: u16) -> String {
    format!(
        "python3 -c \"import socket; s=socket.create_connection(('{host}',{port}),3); s.sendall(b'ping'); print('got', s.recv(10).decode())\" 2>&1 | tail -1"
    )
}

#[test]
fn none_tier_has_only_loopback() {
    if !require_root("none_tier_has_only_loopback") {
        return;
    }
    let w = World::new("n");
    let d = w.daemon(&[]);
    let id = d.create(json!({}));
    let v = d.sh(
        &id,
        "ls /sys/class/net | tr '\\n' ' '; env | grep -ci proxy",
    );
    assert_eq!(v["stdout"], "lo 0\n");
    let v = d.sh(&id, &tcp_cmd("203.0.113.12", 7777));
    assert!(out(&v).contains("unreachable"), "{v}");
    // A daemon that only ran `none` made no links at all.
    assert!(!sh_ok(&format!("ip -n {} -br link", w.d)).contains("sbx"));
}

#[test]
fn allowlist_tier_admits_only_the_list_through_the_proxy() {
    if !require_root("allowlist_tier_admits_only_the_list_through_the_proxy") {
        return;
    }
    let w = World::new("a");
    let d = w.daemon(&[
        "--egress-allow",
        "allowed.test,.allowed.test,forge.test:8443",
    ]);
    let (s, v) = d.call(Method::POST, "/v1/runs", Some(json!({"network": "egress"})));
    assert_eq!((s, v["network"].as_str()), (201, Some("allowlist")), "{v}");
    let a = v["id"].as_str().expect("id").to_string();
    let b = d.create(json!({"network": "allowlist", "egressAllow": ["denied.test"]}));
    let ca = std::fs::read(w.ca()).expect("ca");
    for id in [&a, &b] {
        let r = d
            .req(Method::PUT, &format!("/v1/runs/{id}/files/ca.pem"))
            .body(ca.clone())
            .send()
            .expect("put");
        assert_eq!(r.status().as_u16(), 201);
    }
    // Proxy env is set; only eth0 and lo; no IPv6.
    let v = d.sh(&a, "echo $HTTPS_PROXY $NO_PROXY; ls /sys/class/net | tr '\\n' ' '; cat /proc/sys/net/ipv6/conf/all/disable_ipv6");
    let text = out(&v);
    assert!(
        text.starts_with("http://10.") && text.contains("localhost,127.0.0.1"),
        "{text}"
    );
    assert!(text.contains("eth0 lo 1\n"), "{text}");
    // curl over plain HTTP and over CONNECT, python, git.
    assert_eq!(
        out(&d.sh(&a, "curl -sS http://allowed.test/")),
        "hello from allowed.test\n"
    );
    assert_eq!(
        out(&d.sh(&a, "curl -sS --cacert /work/ca.pem https://allowed.test/")),
        "hello from allowed.test\n"
    );
    assert_eq!(
        out(&d.sh(
            &a,
            "curl -sS --cacert /work/ca.pem https://www.allowed.test/"
        )),
        "hello from allowed.test\n"
    );
    let py = "SSL_CERT_FILE=/work/ca.pem python3 -c \"import urllib.request; print(urllib.request.urlopen('https://allowed.test/').read().decode().strip())\"";
    assert_eq!(out(&d.sh(&a, py)), "hello from allowed.test\n");
    let v = d.sh(
        &a,
        "GIT_SSL_CAINFO=/work/ca.pem git clone -q https://allowed.test/repo.git r && cat r/README",
    );
    assert_eq!(out(&v), "cloned through the proxy\n", "{v}");
    // A denied host: 403 with the entry that would admit it.
    let v = d.sh(&a, "curl -sS -w '%{http_code}' http://denied.test/");
    let text = out(&v);
    assert!(text.ends_with("403"), "{text}");
    assert!(
        text.contains("\"egressAllow\": [\"denied.test\"]")
            && text.contains("SBX_EGRESS_ALLOW=denied.test"),
        "{text}"
    );
    // egressAllow admits it for run b only.
    assert_eq!(
        out(&d.sh(&b, "curl -sS http://denied.test/")),
        "hello from denied.test\n"
    );
    assert!(out(&d.sh(
        &a,
        "curl -s -o /dev/null -w '%{http_code}' http://denied.test/"
    ))
    .ends_with("403"));
    // Port-scoped entries open that port only.
    assert_eq!(
        out(&d.sh(&a, "curl -sS http://forge.test:8443/")),
        "hello from forge.test:8443\n"
    );
    assert!(out(&d.sh(
        &a,
        "curl -s -o /dev/null -w '%{http_code}' http://forge.test:443/"
    ))
    .ends_with("403"));
    // Raw TCP without the proxy has no route.
    let v = d.sh(&a, &tcp_cmd("203.0.113.10", 80));
    assert!(out(&v).contains("unreachable"), "{v}");
    // CONNECT to what must never be reached.
    let (_, run_b) = d.call(Method::GET, &format!("/v1/runs/{b}"), None);
    // Its bridge port is isolated (sent with set_port; set() silently drops it).
    let link = run_b["link"].as_str().expect("link");
    let port = sh(&format!(
        "ip netns exec {} bridge -d link show dev {link}",
        w.d
    ));
    assert!(port.contains("isolated on"), "{port}");
    assert_eq!(run_b["egressAllow"], json!(["denied.test"]));
    let b_ip = run_b["address"].as_str().expect("address").to_string();
    assert_eq!(
        out(&d.sh(
            &b,
            "ip -4 -o addr show eth0 | tr -s ' ' | cut -d' ' -f4 | cut -d/ -f1"
        ))
        .trim(),
        b_ip
    );
    let gw = out(&d.sh(&a, "echo $HTTP_PROXY"))
        .trim()
        .trim_start_matches("http://")
        .split(':')
        .next()
        .unwrap_or("")
        .to_string();
    for target in [
        "169.254.169.254:80".to_string(),
        "127.0.0.1:80".to_string(),
        format!("127.0.0.1:{}", d.port),
        format!("{gw}:{}", d.port),
        format!("daemon.test:{}", d.port),
        format!("{b_ip}:80"),
        "203.0.113.10:443".to_string(),
        "[::ffff:203.0.113.10]:443".to_string(),
        "[::ffff:cb00:710a]:443".to_string(),
        "private.test:443".to_string(),
    ] {
        let line = out(&d.sh(&a, &connect_cmd(&target)));
        assert!(line.starts_with("HTTP/1.1 403"), "CONNECT {target}: {line}");
    }
    assert!(out(&d.sh(&a, &connect_cmd("allowed.test:443"))).starts_with("HTTP/1.1 200"));
    // Another run's proxy refuses this run.
    let other = out(&d.sh(&b, "echo $HTTP_PROXY")).trim().to_string();
    let v = d.sh(
        &a,
        &format!("curl -s -m 5 -x {other} http://allowed.test/; echo rc=$?"),
    );
    assert!(!out(&v).contains("hello"), "{v}");
    // The daemon logged decisions with the run id.
    let log = d.log();
    assert!(
        log.contains(&format!("run=\"{a}\"")) || log.contains(&format!("run={a}")),
        "no decision log"
    );
    // Deleting removes link, table and listener.
    for id in [&a, &b] {
        let (_, run) = d.call(Method::GET, &format!("/v1/runs/{id}"), None);
        assert!(
            !w.run_leftovers(&run).is_empty(),
            "the run had a link: {run}"
        );
        d.call(Method::DELETE, &format!("/v1/runs/{id}"), None);
        assert_eq!(w.run_leftovers(&run), Vec::<String>::new());
    }
    let mut d = d;
    w.assert_clean_after_stop(&mut d);
}

#[test]
fn open_tier_routes_out_but_not_between_runs() {
    if !require_root("open_tier_routes_out_but_not_between_runs") {
        return;
    }
    let w = World::new("o");
    let d = w.daemon(&[]);
    let x = d.create(json!({"network": "open"}));
    let y = d.create(json!({"network": "open"}));
    let (s, v) = d.call(
        Method::POST,
        "/v1/runs",
        Some(json!({"network": "open", "egressAllow": ["a.test"]})),
    );
    assert_eq!(
        (
            s,
            v["message"].as_str().map(|m| m.starts_with("egressAllow"))
        ),
        (400, Some(true))
    );
    let v = d.sh(
        &x,
        "env | grep -ci proxy; ip route 2>/dev/null | head -1 || true",
    );
    assert!(out(&v).starts_with("0\n"), "{v}");
    // Raw TCP to the test internet works (NAT).
    assert_eq!(out(&d.sh(&x, &tcp_cmd("203.0.113.12", 7777))), "got ping\n");
    assert_eq!(
        out(&d.sh(&x, "curl -sS http://203.0.113.11/")),
        "hello from denied.test\n"
    );
    // Not between runs, neither TCP nor ping; not the daemon's API.
    let y_ip = out(&d.sh(&y, "python3 -c \"import socket; s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.connect(('203.0.113.12', 9)); print(s.getsockname()[0])\"")).trim().to_string();
    // An echo server in y: reachable from y itself, not from x.
    let echo = "import socket\ns = socket.socket()\ns.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n\
                s.bind(('0.0.0.0', 8080))\ns.listen()\nwhile True:\n    c, _ = s.accept()\n    c.sendall(c.recv(10))\n    c.close()\n";
    let r = d
        .req(Method::PUT, &format!("/v1/runs/{y}/files/echo.py"))
        .body(echo)
        .send()
        .expect("put");
    assert_eq!(r.status().as_u16(), 201);
    d.sh(&y, "python3 /work/echo.py > /dev/null 2>&1 &");
    wait_for("y listens", 10, || {
        out(&d.sh(&y, &tcp_cmd("127.0.0.1", 8080))) == "got ping\n"
    });
    let v = d.sh(&x, &tcp_cmd(&y_ip, 8080));
    assert!(!out(&v).contains("got"), "{v}");
    let v = d.sh(&x, &ping_cmd(&y_ip));
    assert_ne!(out(&v), "ok\n", "ping between runs must fail");
    let v = d.sh(&x, &ping_cmd("203.0.113.2"));
    assert_eq!(out(&v), "ok\n", "ping out works (ping_group_range is set)");
    let v = d.sh(
        &x,
        &format!(
            "curl -s -m 3 http://203.0.113.1:{}/health; echo rc=$?",
            d.port
        ),
    );
    assert!(!out(&v).contains("\"status\""), "daemon API reachable: {v}");
    let v = d.sh(&x, &format!("ip -4 route 2>/dev/null; curl -s -m 3 http://$(python3 -c \"import socket; s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.connect(('203.0.113.12', 9)); a=s.getsockname()[0].split('.'); print('.'.join(a[:3]+['1']))\"):{}/health; echo rc=$?", d.port));
    assert!(
        !out(&v).contains("\"status\""),
        "daemon API reachable via the gateway: {v}"
    );
    for id in [&x, &y] {
        let (_, run) = d.call(Method::GET, &format!("/v1/runs/{id}"), None);
        d.call(Method::DELETE, &format!("/v1/runs/{id}"), None);
        assert_eq!(w.run_leftovers(&run), Vec::<String>::new());
    }
    let mut d = d;
    w.assert_clean_after_stop(&mut d);
}

#[test]
fn network_state_is_cleaned_after_expiry_and_kill_9() {
    if !require_root("network_state_is_cleaned_after_expiry_and_kill_9") {
        return;
    }
    let w = World::new("k");
    let mut d = w.daemon(&["--egress-allow", "allowed.test"]);
    let short = d.create(json!({"network": "allowlist", "ttlSec": 3}));
    let keep = d.create(json!({"network": "allowlist"}));
    let gone = d.create(json!({"network": "open"}));
    let (_, v) = d.call(Method::GET, &format!("/v1/runs/{short}"), None);
    let short_run = v;
    wait_for("expiry", 30, || {
        d.call(Method::GET, &format!("/v1/runs/{short}"), None).1["status"] == "expired"
    });
    let run = |d: &Daemon, id: &str| d.call(Method::GET, &format!("/v1/runs/{id}"), None).1;
    let (keep_run, gone_run) = (run(&d, &keep), run(&d, &gone));
    assert_eq!(w.run_leftovers(&keep_run).len(), 3, "link, table, proxy");
    // Ports come and go below (expiry, orphans after the restart); the
    // bridges' addresses must not, or the runs' cached gateway goes stale.
    let macs = w.bridge_macs();
    assert_eq!(macs.len(), 2, "{macs:?}");
    wait_for("expired run's network removed", 10, || {
        w.run_leftovers(&short_run).is_empty()
    });
    // kill -9; one run's sandbox dies while the daemon is down.
    let state = d.shim_state(&gone);
    d.kill9();
    for k in ["init_pid", "shim_pid"] {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(state[k].as_i64().expect("pid") as i32),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
    d.spawn();
    // The surviving run still goes out through its (restarted) proxy.
    wait_for("proxy restarted", 10, || {
        out(&d.sh(
            &keep,
            "curl -s -o /dev/null -w '%{http_code}' http://denied.test/",
        )) == "403"
    });
    let v = d.sh(&keep, "curl -sS -m 20 http://allowed.test/");
    assert_eq!(out(&v), "hello from allowed.test\n", "{v}");
    assert_eq!(w.bridge_macs(), macs, "bridge addresses changed");
    wait_for("dead run's network removed", 10, || {
        w.run_leftovers(&gone_run).is_empty()
    });
    assert_eq!(w.run_leftovers(&keep_run).len(), 3, "link, table, proxy");
    let (_, v) = d.call(Method::GET, &format!("/v1/runs/{gone}"), None);
    assert_eq!(v["status"], "error");
    d.call(Method::DELETE, &format!("/v1/runs/{keep}"), None);
    assert_eq!(w.run_leftovers(&keep_run), Vec::<String>::new());
    w.assert_clean_after_stop(&mut d);
}
