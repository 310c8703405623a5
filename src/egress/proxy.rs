//! The per-run egress proxy of the allowlist tier: HTTP CONNECT (for https,
//! git, pip, npm, cargo…) and plain absolute-URI HTTP. It admits a host only
//! when an entry of the run's list does, resolves the name itself, and dials
//! only an address it checked: never loopback, link-local (the metadata
//! address among them), this host's own addresses, the sandbox subnets
//! (other runs), IPv6 forms that embed IPv4, or private ranges unless an
//! entry names that literal. One proxy per run, accepting only that run's
//! address; every decision is logged with the run id.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

use super::allowlist::{entry_for, Entry};

pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(15);
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(300);
pub const MAX_TUNNELS: usize = 64;
const MAX_HEAD: usize = 16 * 1024;

/// What one run's proxy enforces.
#[derive(Debug, Clone)]
pub struct Policy {
    pub run_id: String,
    /// Built-in + deployment + the run's own entries.
    pub entries: Vec<Entry>,
    /// The only peer allowed to use this proxy.
    pub client: IpAddr,
    /// Addresses that are never dialed: this host's own, the sandbox subnets.
    pub forbidden: Vec<(IpAddr, u8)>,
}

/// Why a destination was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    NotAllowed {
        host: String,
        port: u16,
    },
    Address {
        host: String,
        ip: IpAddr,
        why: &'static str,
    },
    IpLiteral {
        host: String,
        port: u16,
    },
}

fn in_net(ip: IpAddr, net: IpAddr, prefix: u8) -> bool {
    match (ip, net) {
        (IpAddr::V4(a), IpAddr::V4(n)) => {
            let m = u32::MAX
                .checked_shl(32 - u32::from(prefix.min(32)))
                .unwrap_or(0);
            u32::from(a) & m == u32::from(n) & m
        }
        (IpAddr::V6(a), IpAddr::V6(n)) => {
            let m = u128::MAX
                .checked_shl(128 - u32::from(prefix.min(128)))
                .unwrap_or(0);
            u128::from(a) & m == u128::from(n) & m
        }
        _ => false,
    }
}

fn v4(a: u8, b: u8, c: u8, d: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(a, b, c, d))
}

fn v6(s: &str) -> IpAddr {
    s.parse::<Ipv6Addr>()
        .map(IpAddr::V6)
        .unwrap_or(IpAddr::V6(Ipv6Addr::UNSPECIFIED))
}

/// Always refused, whatever the list says.
fn never(ip: IpAddr) -> Option<&'static str> {
    let nets: [(IpAddr, u8, &'static str); 14] = [
        (v4(0, 0, 0, 0), 8, "unspecified"),
        (v4(127, 0, 0, 0), 8, "loopback"),
        (v4(169, 254, 0, 0), 16, "link-local (cloud metadata)"),
        (v4(224, 0, 0, 0), 4, "multicast"),
        (v4(240, 0, 0, 0), 4, "reserved"),
        (v6("::"), 128, "unspecified"),
        (v6("::1"), 128, "loopback"),
        (v6("fe80::"), 10, "link-local"),
        (v6("ff00::"), 8, "multicast"),
        (v6("::ffff:0:0"), 96, "IPv4-mapped IPv6"),
        (v6("64:ff9b::"), 96, "NAT64 (embeds IPv4)"),
        (v6("2002::"), 16, "6to4 (embeds IPv4)"),
        (v6("2001::"), 32, "Teredo (embeds IPv4)"),
        (v6("::"), 96, "IPv4-compatible IPv6"),
    ];
    nets.iter()
        .find(|(n, p, _)| in_net(ip, *n, *p))
        .map(|(_, _, why)| *why)
}

/// Refused unless an entry names the literal.
fn private(ip: IpAddr) -> Option<&'static str> {
    let nets: [(IpAddr, u8, &'static str); 6] = [
        (v4(10, 0, 0, 0), 8, "private (10/8)"),
        (v4(172, 16, 0, 0), 12, "private (172.16/12)"),
        (v4(192, 168, 0, 0), 16, "private (192.168/16)"),
        (v4(100, 64, 0, 0), 10, "shared address space (100.64/10)"),
        (v4(192, 0, 0, 0), 24, "IETF protocol assignments"),
        (v6("fc00::"), 7, "unique local (fc00::/7)"),
    ];
    nets.iter()
        .find(|(n, p, _)| in_net(ip, *n, *p))
        .map(|(_, _, why)| *why)
}

impl Policy {
    /// The name-level decision, before any resolution.
    pub fn admit_name(&self, host: &str, port: u16) -> Result<(), Refusal> {
        let host = host.to_ascii_lowercase();
        if let Ok(ip) = host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse::<IpAddr>()
        {
            // An IP literal passes only when an entry names that literal.
            if !self
                .entries
                .iter()
                .any(|e| e.names_ip(ip) && e.admits(&host, port))
            {
                return Err(Refusal::IpLiteral { host, port });
            }
            return Ok(());
        }
        if self.entries.iter().any(|e| e.admits(&host, port)) {
            Ok(())
        } else {
            Err(Refusal::NotAllowed { host, port })
        }
    }

    /// The address-level decision for one resolved address.
    pub fn admit_ip(&self, host: &str, ip: IpAddr) -> Result<(), Refusal> {
        let refuse = |why| {
            Err(Refusal::Address {
                host: host.to_string(),
                ip,
                why,
            })
        };
        if let Some(why) = never(ip) {
            return refuse(why);
        }
        if self.forbidden.iter().any(|(n, p)| in_net(ip, *n, *p)) {
            return refuse("this host or the sandbox network");
        }
        if let Some(why) = private(ip) {
            if !self.entries.iter().any(|e| e.names_ip(ip)) {
                return refuse(why);
            }
        }
        Ok(())
    }
}

impl Refusal {
    /// The 403 body: what was refused, and the exact entry that would admit it.
    pub fn body(&self, run_id: &str) -> String {
        match self {
            Refusal::NotAllowed { host, port } | Refusal::IpLiteral { host, port } => {
                let entry = entry_for(host.trim_start_matches('[').trim_end_matches(']'), *port);
                let what = if matches!(self, Refusal::IpLiteral { .. }) {
                    "is an IP literal no entry names"
                } else {
                    "is not on the allowlist"
                };
                format!(
                    "sbx egress: {host}:{port} {what} (run {run_id}).\n\
                     Allow it for one run:  \"egressAllow\": [\"{entry}\"]\n\
                     Allow it for every run: SBX_EGRESS_ALLOW={entry}\n"
                )
            }
            Refusal::Address { host, ip, why } => {
                format!("sbx egress: {host} resolves to {ip}, which is refused ({why}) (run {run_id}).\n")
            }
        }
    }
}

fn response(status: &str, body: &str) -> Vec<u8> {
    format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// A parsed request head.
#[derive(Debug, PartialEq, Eq)]
pub struct Head {
    pub connect: bool,
    pub host: String,
    pub port: u16,
    /// For plain HTTP: the head rewritten to origin form.
    pub forward: Vec<u8>,
}

/// Parses a proxy request head (CONNECT authority, or an absolute http:// URI).
pub fn parse_head(raw: &[u8]) -> Result<Head, &'static str> {
    let text = std::str::from_utf8(raw).map_err(|_| "request head is not UTF-8")?;
    let mut lines = text.split("\r\n");
    let first = lines.next().ok_or("empty request")?;
    let mut parts = first.split(' ');
    let (method, target, version) = (
        parts.next().ok_or("no method")?,
        parts.next().ok_or("no target")?,
        parts.next().ok_or("no version")?,
    );
    if !version.starts_with("HTTP/1.") {
        return Err("not HTTP/1.x");
    }
    let split_authority = |auth: &str, default: u16| -> Result<(String, u16), &'static str> {
        if let Some(rest) = auth.strip_prefix('[') {
            let (h, after) = rest.split_once(']').ok_or("bad IPv6 authority")?;
            let port = match after.strip_prefix(':') {
                Some(p) => p.parse().map_err(|_| "bad port")?,
                None => default,
            };
            return Ok((h.to_string(), port));
        }
        match auth.rsplit_once(':') {
            Some((h, p)) => Ok((h.to_string(), p.parse().map_err(|_| "bad port")?)),
            None => Ok((auth.to_string(), default)),
        }
    };
    if method.eq_ignore_ascii_case("CONNECT") {
        let (host, port) = split_authority(target, 443)?;
        if host.is_empty() {
            return Err("empty host");
        }
        return Ok(Head {
            connect: true,
            host: host.to_ascii_lowercase(),
            port,
            forward: Vec::new(),
        });
    }
    let rest = target
        .strip_prefix("http://")
        .ok_or("only CONNECT and absolute http:// URIs are proxied")?;
    let (auth, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    let auth = auth.rsplit_once('@').map(|(_, a)| a).unwrap_or(auth);
    let (host, port) = split_authority(auth, 80)?;
    if host.is_empty() {
        return Err("empty host");
    }
    let mut forward = format!("{method} {path} {version}\r\n");
    for line in lines {
        if line.is_empty() {
            break;
        }
        let name = line
            .split(':')
            .next()
            .unwrap_or("")
            .trim()
            .to_ascii_lowercase();
        if name.starts_with("proxy-") || name == "connection" || name == "keep-alive" {
            continue;
        }
        forward.push_str(line);
        forward.push_str("\r\n");
    }
    forward.push_str("Connection: close\r\n\r\n");
    Ok(Head {
        connect: false,
        host: host.to_ascii_lowercase(),
        port,
        forward: forward.into_bytes(),
    })
}

async fn read_head(s: &mut TcpStream) -> std::io::Result<(Vec<u8>, Vec<u8>)> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 2048];
    loop {
        let n = s.read(&mut chunk).await?;
        if n == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "closed before the head ended",
            ));
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let rest = buf.split_off(i + 4);
            return Ok((buf, rest));
        }
        if buf.len() > MAX_HEAD {
            return Err(std::io::Error::other("request head too large"));
        }
    }
}

/// Copies one way until EOF, an error, or nothing moves for `idle`; then
/// shuts the writer so the other side sees the end.
async fn copy_idle(
    mut from: impl tokio::io::AsyncRead + Unpin,
    mut to: impl tokio::io::AsyncWrite + Unpin,
    idle: Duration,
) {
    let mut buf = vec![0u8; 32 * 1024];
    loop {
        match tokio::time::timeout(idle, from.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) | Err(_) => break,
            Ok(Ok(n)) => {
                if to.write_all(&buf[..n]).await.is_err() {
                    break;
                }
            }
        }
    }
    let _ = to.shutdown().await;
}

/// Copies both ways until either side closes or nothing moves for `idle`.
async fn splice(a: TcpStream, b: TcpStream, idle: Duration) {
    let (ar, aw) = a.into_split();
    let (br, bw) = b.into_split();
    tokio::join!(copy_idle(ar, bw, idle), copy_idle(br, aw, idle));
}

async fn handle(mut client: TcpStream, policy: Arc<Policy>) {
    let run = policy.run_id.as_str();
    let (raw, rest) = match tokio::time::timeout(HEAD_TIMEOUT, read_head(&mut client)).await {
        Ok(Ok(h)) => h,
        _ => return,
    };
    let head = match parse_head(&raw) {
        Ok(h) => h,
        Err(why) => {
            tracing::info!(run, decision = "bad_request", why, "egress");
            let _ = client
                .write_all(&response(
                    "400 Bad Request",
                    &format!("sbx egress: {why}\n"),
                ))
                .await;
            return;
        }
    };
    let (host, port) = (head.host.clone(), head.port);
    if let Err(r) = policy.admit_name(&host, port) {
        tracing::info!(run, %host, port, decision = "deny", reason = ?r, "egress");
        let _ = client
            .write_all(&response("403 Forbidden", &r.body(run)))
            .await;
        return;
    }
    // Resolve here and dial only what was checked.
    let lookup = host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_string();
    let addrs: Vec<SocketAddr> = match tokio::net::lookup_host((lookup.as_str(), port)).await {
        Ok(a) => a.collect(),
        Err(e) => {
            tracing::info!(run, %host, port, decision = "unresolved", error = %e, "egress");
            let _ = client
                .write_all(&response(
                    "502 Bad Gateway",
                    &format!("sbx egress: cannot resolve {host}: {e}\n"),
                ))
                .await;
            return;
        }
    };
    let mut refusal = None;
    let mut allowed = Vec::new();
    for a in addrs {
        match policy.admit_ip(&host, a.ip()) {
            Ok(()) => allowed.push(a),
            Err(r) => refusal = Some(r),
        }
    }
    if allowed.is_empty() {
        let r = refusal.unwrap_or(Refusal::NotAllowed {
            host: host.clone(),
            port,
        });
        tracing::info!(run, %host, port, decision = "deny", reason = ?r, "egress");
        let _ = client
            .write_all(&response("403 Forbidden", &r.body(run)))
            .await;
        return;
    }
    let mut upstream = None;
    for a in &allowed {
        if let Ok(Ok(s)) = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(a)).await {
            upstream = Some((s, *a));
            break;
        }
    }
    let Some((mut up, addr)) = upstream else {
        tracing::info!(run, %host, port, decision = "unreachable", "egress");
        let _ = client
            .write_all(&response(
                "502 Bad Gateway",
                &format!("sbx egress: cannot connect to {host}:{port}\n"),
            ))
            .await;
        return;
    };
    tracing::info!(run, %host, port, %addr, decision = "allow", connect = head.connect, "egress");
    if head.connect {
        if client
            .write_all(b"HTTP/1.1 200 Connection established\r\n\r\n")
            .await
            .is_err()
        {
            return;
        }
    } else if up.write_all(&head.forward).await.is_err() {
        return;
    }
    if !rest.is_empty() && up.write_all(&rest).await.is_err() {
        return;
    }
    splice(client, up, IDLE_TIMEOUT).await;
}

/// Serves one run's proxy until the task is aborted.
pub async fn serve(listener: TcpListener, policy: Arc<Policy>) {
    let tunnels = Arc::new(Semaphore::new(MAX_TUNNELS));
    loop {
        let Ok((mut conn, peer)) = listener.accept().await else {
            continue;
        };
        if peer.ip() != policy.client {
            tracing::warn!(run = %policy.run_id, %peer, decision = "deny", "egress proxy used by another address");
            continue;
        }
        let Ok(permit) = tunnels.clone().try_acquire_owned() else {
            tracing::info!(run = %policy.run_id, decision = "deny", "too many tunnels");
            let _ = conn
                .write_all(&response(
                    "429 Too Many Requests",
                    "sbx egress: too many open tunnels\n",
                ))
                .await;
            continue;
        };
        let p = policy.clone();
        tokio::spawn(async move {
            handle(conn, p).await;
            drop(permit);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::egress::allowlist::parse_list;

    fn policy(extra: &[&str]) -> Policy {
        let mut entries = parse_list(&["allowed.test", "forge.example.com:8443"]).expect("list");
        entries.extend(parse_list(extra).expect("extra"));
        Policy {
            run_id: "R".into(),
            entries,
            client: v4(10, 88, 0, 2),
            forbidden: vec![(v4(10, 88, 0, 0), 16), (v4(192, 0, 2, 1), 32)],
        }
    }

    #[test]
    fn names_are_admitted_by_entries_only() {
        let p = policy(&[]);
        assert_eq!(p.admit_name("allowed.test", 443), Ok(()));
        assert_eq!(p.admit_name("ALLOWED.test", 80), Ok(()));
        assert!(matches!(
            p.admit_name("allowed.test", 22),
            Err(Refusal::NotAllowed { .. })
        ));
        assert_eq!(p.admit_name("forge.example.com", 8443), Ok(()));
        assert!(matches!(
            p.admit_name("denied.test", 443),
            Err(Refusal::NotAllowed { .. })
        ));
        assert!(matches!(
            p.admit_name("203.0.113.5", 443),
            Err(Refusal::IpLiteral { .. })
        ));
        let p = policy(&["203.0.113.5"]);
        assert_eq!(p.admit_name("203.0.113.5", 443), Ok(()));
    }

    #[test]
    fn dangerous_addresses_are_refused_even_for_allowed_names() {
        let p = policy(&["10.9.9.9"]);
        for (ip, refused) in [
            ("127.0.0.1", true),
            ("169.254.169.254", true),
            ("10.88.0.3", true),    // another run
            ("192.0.2.1", true),    // this host
            ("10.1.2.3", true),     // private, not named
            ("10.9.9.9", false),    // private, named
            ("203.0.113.7", false), // public
            ("::ffff:127.0.0.1", true),
            ("64:ff9b::a00:1", true),
            ("2002:a00:1::", true),
            ("2001:0:4136:e378::1", true),
            ("fe80::1", true),
            ("fd00::1", true),
            ("2606:4700::1", false),
        ] {
            let r = p.admit_ip("allowed.test", ip.parse().expect("ip"));
            assert_eq!(r.is_err(), refused, "{ip}: {r:?}");
        }
    }

    #[test]
    fn denial_names_the_entry_and_the_deployment_variable() {
        let body = Refusal::NotAllowed {
            host: "example.com".into(),
            port: 8443,
        }
        .body("01R");
        assert!(
            body.contains("\"egressAllow\": [\"example.com:8443\"]"),
            "{body}"
        );
        assert!(body.contains("SBX_EGRESS_ALLOW=example.com:8443"), "{body}");
        let body = Refusal::NotAllowed {
            host: "example.com".into(),
            port: 443,
        }
        .body("01R");
        assert!(
            body.contains("[\"example.com\"]") && body.contains("run 01R"),
            "{body}"
        );
    }

    #[test]
    fn heads_parse_and_http_is_rewritten_to_origin_form() {
        let h = parse_head(b"CONNECT allowed.test:443 HTTP/1.1\r\nHost: allowed.test:443\r\n\r\n")
            .expect("connect");
        assert_eq!(
            (h.connect, h.host.as_str(), h.port),
            (true, "allowed.test", 443)
        );
        let h = parse_head(b"CONNECT [fd00::1]:22 HTTP/1.1\r\n\r\n").expect("v6");
        assert_eq!((h.host.as_str(), h.port), ("fd00::1", 22));
        let h = parse_head(b"GET http://user@allowed.test/x?y=1 HTTP/1.1\r\nHost: allowed.test\r\nProxy-Authorization: x\r\nConnection: keep-alive\r\nAccept: */*\r\n\r\n").expect("get");
        assert_eq!(
            (h.connect, h.host.as_str(), h.port),
            (false, "allowed.test", 80)
        );
        assert_eq!(
            String::from_utf8(h.forward).expect("utf8"),
            "GET /x?y=1 HTTP/1.1\r\nHost: allowed.test\r\nAccept: */*\r\nConnection: close\r\n\r\n"
        );
        assert!(parse_head(b"GET /relative HTTP/1.1\r\n\r\n").is_err());
        assert!(parse_head(b"GET https://x.test/ HTTP/1.1\r\n\r\n").is_err());
    }
}
