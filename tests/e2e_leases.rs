//! End-to-end: writable leases with fencing tokens against a real daemon,
//! including a randomized concurrent history checked against a model.

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{require_root, Daemon};
use reqwest::Method;
use serde_json::{json, Value};

fn lease(d: &Daemon, id: &str, body: Value, path: &str) -> (u16, Value) {
    d.call(Method::POST, &format!("/v1/runs/{id}/{path}"), Some(body))
}

#[test]
fn lease_semantics() {
    if !require_root("lease_semantics") {
        return;
    }
    let mut d = Daemon::start(&[]);
    let id = d.create(json!({}));
    let (s, v) = lease(&d, &id, json!({"owner": "alice", "ttlSec": 60}), "lease");
    assert_eq!(s, 200, "{v}");
    assert_eq!(
        (
            v["lease"]["holder"].as_str(),
            v["lease"]["generation"].as_u64()
        ),
        (Some("alice"), Some(1))
    );
    let (_, run) = d.call(Method::GET, &format!("/v1/runs/{id}"), None);
    assert_eq!(run["lease"]["holder"], "alice");
    // Writes without the credential, or with another's, are refused: held.
    let (s, v) = d.call(
        Method::POST,
        &format!("/v1/runs/{id}/exec"),
        Some(json!({"cmd": "true"})),
    );
    assert_eq!(
        (s, v["error"].as_str(), v["holder"].as_str()),
        (409, Some("held"), Some("alice")),
        "{v}"
    );
    assert!(
        v["expiresAt"].as_str().is_some_and(|t| t.ends_with('Z')),
        "{v}"
    );
    let ok = d.exec(
        &id,
        json!({"cmd": "echo held > f", "owner": "alice", "generation": 1}),
    );
    assert_eq!(ok["exitCode"], 0);
    let put = |q: &str| {
        d.req(Method::PUT, &format!("/v1/runs/{id}/files/g{q}"))
            .body("x")
            .send()
            .expect("put")
            .status()
            .as_u16()
    };
    assert_eq!(put(""), 409);
    assert_eq!(put("?owner=bob&generation=1"), 409);
    assert_eq!(put("?owner=alice&generation=1"), 201);
    assert_eq!(put("?owner=alice"), 400);
    // Reads stay open.
    let r = d
        .req(Method::GET, &format!("/v1/runs/{id}/files/f"))
        .send()
        .expect("get");
    assert_eq!(r.text().expect("text"), "held\n");
    // Another owner cannot take it; the same owner re-acquires with a new generation.
    let (s, v) = lease(&d, &id, json!({"owner": "bob", "ttlSec": 60}), "lease");
    assert_eq!((s, v["error"].as_str()), (409, Some("held")));
    let (_, v) = lease(&d, &id, json!({"owner": "alice", "ttlSec": 60}), "lease");
    assert_eq!(v["lease"]["generation"], 2);
    let (s, v) = lease(
        &d,
        &id,
        json!({"owner": "alice", "generation": 1, "ttlSec": 60}),
        "lease/renew",
    );
    assert_eq!((s, v["error"].as_str()), (409, Some("superseded")), "{v}");
    let (s, v) = lease(
        &d,
        &id,
        json!({"owner": "alice", "generation": 2, "ttlSec": 1}),
        "lease/renew",
    );
    assert_eq!(s, 200, "{v}");
    // Lapse: the old credential is dead, the pre-lease path opens again.
    std::thread::sleep(Duration::from_millis(1300));
    let (s, v) = d.call(
        Method::POST,
        &format!("/v1/runs/{id}/exec"),
        Some(json!({"cmd": "true", "owner": "alice", "generation": 2})),
    );
    assert_eq!((s, v["error"].as_str()), (409, Some("superseded")), "{v}");
    assert_eq!(d.sh(&id, "true")["exitCode"], 0);
    let (_, run) = d.call(Method::GET, &format!("/v1/runs/{id}"), None);
    assert_eq!(run["lease"], Value::Null);
    // Busy while an exec is in flight.
    let (s, v) = std::thread::scope(|sc| {
        let slow = sc.spawn(|| d.exec(&id, json!({"cmd": ["sleep", "2"]})));
        std::thread::sleep(Duration::from_millis(700));
        let r = lease(&d, &id, json!({"owner": "bob", "ttlSec": 60}), "lease");
        slow.join().expect("slow exec");
        r
    });
    assert_eq!((s, v["error"].as_str()), (409, Some("busy")), "{v}");
    let (_, v) = lease(&d, &id, json!({"owner": "bob", "ttlSec": 600}), "lease");
    assert_eq!(v["lease"]["generation"], 3);
    // The generation survives kill -9, and so does the lease.
    d.kill9();
    d.spawn();
    let (s, v) = d.call(
        Method::POST,
        &format!("/v1/runs/{id}/exec"),
        Some(json!({"cmd": "true"})),
    );
    assert_eq!((s, v["holder"].as_str()), (409, Some("bob")), "{v}");
    let (s, _) = lease(
        &d,
        &id,
        json!({"owner": "bob", "generation": 3}),
        "lease/release",
    );
    assert_eq!(s, 204);
    let (s, v) = lease(
        &d,
        &id,
        json!({"owner": "bob", "generation": 3}),
        "lease/release",
    );
    assert_eq!((s, v["error"].as_str()), (409, Some("superseded")));
    let (_, v) = lease(&d, &id, json!({"owner": "carol", "ttlSec": 60}), "lease");
    assert_eq!(v["lease"]["generation"], 4);
    // Bad input names the field; the lease dies with the run.
    let (s, v) = lease(&d, &id, json!({"owner": "", "ttlSec": 60}), "lease");
    assert_eq!(
        (s, v["message"].as_str().map(|m| m.starts_with("owner:"))),
        (400, Some(true))
    );
    let (s, v) = lease(
        &d,
        &id,
        json!({"owner": "x", "ttlSec": 60, "extra": 1}),
        "lease",
    );
    assert_eq!(s, 400, "{v}");
    d.call(Method::DELETE, &format!("/v1/runs/{id}"), None);
    let (_, run) = d.call(Method::GET, &format!("/v1/runs/{id}"), None);
    assert_eq!(run["lease"], Value::Null);
    let (s, _) = lease(&d, &id, json!({"owner": "carol", "ttlSec": 60}), "lease");
    assert_eq!(s, 409);
}

#[derive(Debug, Clone)]
enum Kind {
    Acquire { ttl_ms: u64 },
    Renew { ttl_ms: u64 },
    Release,
    Exec,
    Put,
}

#[derive(Debug, Clone)]
struct Op {
    kind: Kind,
    owner: String,
    cred: Option<u64>,
    start: Instant,
    end: Instant,
    /// 0 when the request got no answer (daemon down).
    status: u16,
    error: Option<String>,
    generation: Option<u64>,
}

const SLACK: Duration = Duration::from_millis(100);

/// Checks a recorded history against the lease model; returns violations.
fn check(history: &[Op]) -> Vec<String> {
    let mut bad = Vec::new();
    let ok = |o: &&Op| matches!(o.status, 200 | 201 | 204);
    let grants: Vec<&Op> = history
        .iter()
        .filter(|o| matches!(o.kind, Kind::Acquire { .. }))
        .filter(ok)
        .collect();
    // (a) Generations are unique and follow real time.
    for (i, a) in grants.iter().enumerate() {
        for b in &grants[i + 1..] {
            if a.generation == b.generation {
                bad.push(format!("generation {:?} granted twice", a.generation));
            }
            if a.end < b.start && a.generation >= b.generation {
                bad.push(format!(
                    "grant {:?} then {:?} went backwards",
                    a.generation, b.generation
                ));
            }
            if b.end < a.start && b.generation >= a.generation {
                bad.push(format!(
                    "grant {:?} then {:?} went backwards",
                    b.generation, a.generation
                ));
            }
        }
    }
    let writes: Vec<&Op> = history
        .iter()
        .filter(|o| matches!(o.kind, Kind::Exec | Kind::Put))
        .filter(ok)
        .collect();
    for w in &writes {
        match w.cred {
            Some(g) => {
                // (b) The credential was granted to this owner and was still current.
                let Some(grant) = grants.iter().find(|a| a.generation == Some(g)) else {
                    bad.push(format!("write with generation {g} that was never granted"));
                    continue;
                };
                if grant.owner != w.owner {
                    bad.push(format!(
                        "write by {} with {}'s generation {g}",
                        w.owner, grant.owner
                    ));
                }
                if let Some(later) = grants
                    .iter()
                    .find(|a| a.generation > Some(g) && a.end < w.start)
                {
                    bad.push(format!(
                        "write with generation {g} after generation {:?} was granted",
                        later.generation
                    ));
                }
                if let Some(r) = history.iter().filter(ok).find(|o| {
                    matches!(o.kind, Kind::Release) && o.cred == Some(g) && o.end < w.start
                }) {
                    bad.push(format!(
                        "write with generation {g} after its release by {}",
                        r.owner
                    ));
                }
                // Certainly lapsed: no grant or renewal could have kept it alive.
                let mut alive_until = grant.end + ttl(grant);
                for r in history.iter().filter(ok).filter(|o| {
                    matches!(o.kind, Kind::Renew { .. }) && o.cred == Some(g) && o.start < w.end
                }) {
                    alive_until = alive_until.max(r.end + ttl(r));
                }
                if w.start > alive_until + SLACK {
                    bad.push(format!(
                        "write with generation {g} after the lease certainly lapsed"
                    ));
                }
            }
            None => {
                // (d) No lease was certainly in force through the whole write.
                for a in &grants {
                    // A renewal may shorten the lease: its earliest possible
                    // expiry counts too.
                    let earliest_expiry = history
                        .iter()
                        .filter(|o| o.status != 409 && o.status != 400)
                        .filter(|o| {
                            matches!(o.kind, Kind::Renew { .. })
                                && o.cred == a.generation
                                && o.start < w.end
                        })
                        .map(|r| r.start + ttl(r))
                        .fold(a.start + ttl(a), Instant::min);
                    let certainly_active = a.end < w.start && w.end + SLACK < earliest_expiry;
                    let released = history
                        .iter()
                        .filter(|o| o.status != 409 && o.status != 400)
                        .any(|o| {
                            matches!(o.kind, Kind::Release)
                                && o.cred == a.generation
                                && o.start < w.end
                        });
                    // A later grant (same owner re-acquiring, or anyone
                    // after expiry) replaces it; that lease is judged alone.
                    let replaced =
                        history
                            .iter()
                            .filter(|o| matches!(o.status, 0 | 200))
                            .any(|o| {
                                matches!(o.kind, Kind::Acquire { .. })
                                    && o.generation != a.generation
                                    && o.end > a.start
                                    && o.start < w.end
                            });
                    if certainly_active && !released && !replaced {
                        bad.push(format!(
                            "unfenced write while generation {:?} was in force",
                            a.generation
                        ));
                    }
                }
            }
        }
    }
    // (c) Fenced writes follow generation order in real time.
    for w1 in writes.iter().filter(|w| w.cred.is_some()) {
        for w2 in writes.iter().filter(|w| w.cred > w1.cred) {
            if w2.end < w1.start {
                bad.push(format!(
                    "write with generation {:?} finished before one with {:?} began",
                    w2.cred, w1.cred
                ));
            }
        }
    }
    bad
}

fn ttl(o: &Op) -> Duration {
    match o.kind {
        Kind::Acquire { ttl_ms } | Kind::Renew { ttl_ms } => Duration::from_millis(ttl_ms),
        _ => Duration::ZERO,
    }
}

#[test]
fn model_check_flags_a_stale_write() {
    // The checker itself must catch what it is for.
    let t0 = Instant::now();
    let at = |ms: u64| t0 + Duration::from_millis(ms);
    let op = |kind, owner: &str, cred, s, e, status, generation| Op {
        kind,
        owner: owner.into(),
        cred,
        start: at(s),
        end: at(e),
        status,
        error: None,
        generation,
    };
    let history = vec![
        op(Kind::Acquire { ttl_ms: 100 }, "a", None, 0, 5, 200, Some(1)),
        op(
            Kind::Acquire { ttl_ms: 1000 },
            "b",
            None,
            300,
            305,
            200,
            Some(2),
        ),
        op(Kind::Exec, "a", Some(1), 400, 410, 200, None),
        op(Kind::Put, "c", None, 320, 330, 201, None),
    ];
    let v = check(&history);
    assert!(
        v.iter()
            .any(|m| m.contains("after generation Some(2) was granted")),
        "{v:?}"
    );
    assert!(v.iter().any(|m| m.contains("certainly lapsed")), "{v:?}");
    assert!(
        v.iter()
            .any(|m| m.contains("unfenced write while generation Some(2)")),
        "{v:?}"
    );
    assert!(check(&history[..2]).is_empty());
}

#[test]
fn randomized_history_with_kill_9_matches_the_model() {
    if !require_root("randomized_history_with_kill_9_matches_the_model") {
        return;
    }
    const CLIENTS: usize = 6;
    const OPS_PER_CLIENT: usize = 190;
    let daemon = Arc::new(Mutex::new(Daemon::start(&[])));
    let (base, token, id) = {
        let d = daemon.lock().expect("daemon");
        (
            d.url(""),
            d.token.clone(),
            d.create(json!({"ttlSec": 3600})),
        )
    };
    let history: Arc<Mutex<Vec<Op>>> = Arc::default();
    let done = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut seed: u64 = std::env::var("SBX_HISTORY_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1)
        });
    eprintln!("history seed {seed} (SBX_HISTORY_SEED to replay)");
    std::thread::scope(|sc| {
        for c in 0..CLIENTS {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let mut rng = seed ^ (c as u64 + 1);
            let (base, token, id, history, done) = (
                base.clone(),
                token.clone(),
                id.clone(),
                history.clone(),
                done.clone(),
            );
            sc.spawn(move || {
                let mut next = move |n: u64| {
                    rng ^= rng << 13;
                    rng ^= rng >> 7;
                    rng ^= rng << 17;
                    rng % n
                };
                let http = reqwest::blocking::Client::builder().timeout(Duration::from_secs(30)).build().expect("client");
                let owners = ["alice", "bob", "carol"];
                // Generations this client was granted, per owner.
                let mut mine: Vec<(String, u64)> = Vec::new();
                for _ in 0..OPS_PER_CLIENT {
                    std::thread::sleep(Duration::from_millis(next(25)));
                    // Mostly this client's own owner name, sometimes another's.
                    let owner = owners[if next(5) == 0 { next(3) as usize } else { c % 3 }].to_string();
                    let known: Vec<u64> = mine.iter().filter(|(o, _)| *o == owner).map(|(_, g)| *g).collect();
                    // Usually the newest credential, sometimes a stale one, sometimes none.
                    let cred = match (known.last(), next(20)) {
                        (Some(g), 0..=16) => Some(*g),
                        (Some(_), 17) => known.get(next(known.len() as u64) as usize).copied(),
                        _ => None,
                    };
                    let ttl_ms = 300 + next(1200);
                    let (kind, method, path, body): (Kind, Method, String, Option<Value>) = match next(20) {
                        0..=3 => (Kind::Acquire { ttl_ms }, Method::POST, format!("/v1/runs/{id}/lease"), Some(json!({"owner": owner, "ttlSec": ttl_ms.div_ceil(1000)}))),
                        4 | 5 => (Kind::Renew { ttl_ms }, Method::POST, format!("/v1/runs/{id}/lease/renew"), Some(json!({"owner": owner, "generation": cred.unwrap_or(0), "ttlSec": ttl_ms.div_ceil(1000)}))),
                        6 => (Kind::Release, Method::POST, format!("/v1/runs/{id}/lease/release"), Some(json!({"owner": owner, "generation": cred.unwrap_or(0)}))),
                        7..=13 => {
                            let mut b = json!({"cmd": if next(4) == 0 { json!(["sleep", "0.05"]) } else { json!(["true"]) }});
                            if let Some(g) = cred {
                                b["owner"] = json!(owner);
                                b["generation"] = json!(g);
                            }
                            (Kind::Exec, Method::POST, format!("/v1/runs/{id}/exec"), Some(b))
                        }
                        _ => {
                            let q = cred.map(|g| format!("?owner={owner}&generation={g}")).unwrap_or_default();
                            (Kind::Put, Method::PUT, format!("/v1/runs/{id}/files/h{c}.txt{q}"), None)
                        }
                    };
                    // Renew and release always carry a credential (0 = none held).
                    let op_cred = match kind {
                        Kind::Renew { .. } | Kind::Release => Some(cred.unwrap_or(0)),
                        _ => cred,
                    };
                    let mut rb = http.request(method, format!("{base}{path}")).bearer_auth(&token).header("accept", "application/json");
                    rb = match (&kind, body) {
                        (Kind::Put, _) => rb.body(format!("client {c}")),
                        (_, Some(b)) => rb.json(&b),
                        _ => rb,
                    };
                    let start = Instant::now();
                    let resp = rb.send().and_then(|r| {
                        let s = r.status().as_u16();
                        r.text().map(|t| (s, t))
                    });
                    let end = Instant::now();
                    let (status, text) = resp.unwrap_or((0, String::new()));
                    let v: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
                    let generation = v["lease"]["generation"].as_u64();
                    if let (Kind::Acquire { .. }, Some(g), 200) = (&kind, generation, status) {
                        mine.push((owner.clone(), g));
                    }
                    if matches!(kind, Kind::Exec) && status == 200 {
                        assert!(v["exitCode"] == 0 || v["exitCode"] == 125, "exec result {v}");
                    }
                    assert!(matches!(status, 0 | 200 | 201 | 204 | 409 | 503), "unexpected {status}: {text}");
                    history.lock().expect("history").push(Op {
                        kind,
                        owner,
                        cred: op_cred,
                        start,
                        end,
                        status,
                        error: v["error"].as_str().map(str::to_string),
                        generation,
                    });
                    done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            });
        }
        // Halfway through, kill -9 the daemon and bring it back.
        let daemon = daemon.clone();
        let done = done.clone();
        sc.spawn(move || {
            while done.load(std::sync::atomic::Ordering::Relaxed) < CLIENTS * OPS_PER_CLIENT / 2 {
                std::thread::sleep(Duration::from_millis(5));
            }
            let mut d = daemon.lock().expect("daemon");
            d.kill9();
            std::thread::sleep(Duration::from_millis(100));
            d.spawn();
        });
    });
    let history = history.lock().expect("history");
    let count = |f: &dyn Fn(&Op) -> bool| history.iter().filter(|o| f(o)).count();
    let granted = count(&|o| matches!(o.kind, Kind::Acquire { .. }) && o.status == 200);
    let fenced_ok = count(&|o| {
        matches!(o.kind, Kind::Exec | Kind::Put)
            && o.cred.is_some()
            && matches!(o.status, 200 | 201)
    });
    let open_ok = count(&|o| {
        matches!(o.kind, Kind::Exec | Kind::Put)
            && o.cred.is_none()
            && matches!(o.status, 200 | 201)
    });
    let by_error = |e: &str| count(&|o| o.error.as_deref() == Some(e));
    eprintln!(
        "history: {} operations, {granted} grants, {fenced_ok} fenced writes and {open_ok} unfenced writes succeeded, \
         409s: {} busy / {} held / {} superseded, {} unanswered (daemon down)",
        history.len(),
        by_error("busy"),
        by_error("held"),
        by_error("superseded"),
        count(&|o| o.status == 0)
    );
    assert!(history.len() >= 1000);
    assert!(
        granted > 10 && fenced_ok > 10 && by_error("superseded") > 0 && by_error("held") > 0,
        "the history exercised too little"
    );
    let violations = check(&history);
    assert!(
        violations.is_empty(),
        "{} violations, first: {:?}",
        violations.len(),
        &violations[..violations.len().min(10)]
    );
}
