//! The CLI client: talks to the daemon's API with the token file on the host.

use std::io::{BufRead, Read, Write};
use std::path::PathBuf;

use anyhow::{bail, Context};
use base64::Engine;
use serde_json::{json, Value};

#[derive(Debug, clap::Args, Clone)]
pub struct Conn {
    /// Daemon URL.
    #[arg(
        long,
        env = "SBX_URL",
        default_value = "http://127.0.0.1:7439",
        global = true
    )]
    url: String,
    /// Token file (read when SBX_TOKEN is unset).
    #[arg(
        long,
        env = "SBX_TOKEN_FILE",
        default_value = "/var/lib/sbx/token",
        global = true
    )]
    token_file: PathBuf,
}

#[derive(Debug, clap::Subcommand)]
pub enum ClientCommand {
    /// Create a run (and run a command in it when one is given).
    Run {
        #[command(flatten)]
        conn: Conn,
        #[arg(long)]
        image: Option<String>,
        #[arg(long)]
        template: Option<String>,
        #[arg(long)]
        ttl: Option<u64>,
        #[arg(long)]
        network: Option<String>,
        /// KEY=VALUE (repeatable).
        #[arg(long = "env", short = 'e')]
        env: Vec<String>,
        /// KEY=VALUE (repeatable).
        #[arg(long = "label", short = 'l')]
        labels: Vec<String>,
        #[arg(long)]
        cpu: Option<f64>,
        #[arg(long)]
        memory_mb: Option<u64>,
        #[arg(long)]
        pids: Option<u32>,
        /// Delete the run after the command.
        #[arg(long)]
        rm: bool,
        cmd: Vec<String>,
    },
    /// Run a command in a run; exits with its exit code.
    Exec {
        #[command(flatten)]
        conn: Conn,
        id: String,
        #[arg(long)]
        timeout: Option<u64>,
        #[arg(long = "env", short = 'e')]
        env: Vec<String>,
        #[arg(long)]
        cwd: Option<String>,
        /// Lease credential: owner (with --generation).
        #[arg(long)]
        owner: Option<String>,
        #[arg(long)]
        generation: Option<u64>,
        #[arg(required = true, trailing_var_arg = true)]
        cmd: Vec<String>,
    },
    /// List runs.
    Ls {
        #[command(flatten)]
        conn: Conn,
        #[arg(long)]
        status: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// Delete runs.
    Rm {
        #[command(flatten)]
        conn: Conn,
        #[arg(long)]
        purge: bool,
        #[arg(required = true)]
        ids: Vec<String>,
    },
    /// Manage images.
    #[command(subcommand)]
    Image(ImageCommand),
    /// Writable leases (the generation is the fencing token).
    #[command(subcommand)]
    Lease(LeaseCommand),
    /// Copy a file: `sbx cp LOCAL ID:PATH` or `sbx cp ID:PATH LOCAL` (PATH relative to /work).
    Cp {
        #[command(flatten)]
        conn: Conn,
        src: String,
        dst: String,
    },
}

#[derive(Debug, clap::Subcommand)]
pub enum LeaseCommand {
    /// Take the lease; prints the generation.
    Acquire {
        #[command(flatten)]
        conn: Conn,
        id: String,
        #[arg(long)]
        owner: String,
        #[arg(long, default_value_t = 300)]
        ttl: u64,
    },
    /// Extend the lease from now.
    Renew {
        #[command(flatten)]
        conn: Conn,
        id: String,
        #[arg(long)]
        owner: String,
        #[arg(long)]
        generation: u64,
        #[arg(long, default_value_t = 300)]
        ttl: u64,
    },
    /// Give the lease up.
    Release {
        #[command(flatten)]
        conn: Conn,
        id: String,
        #[arg(long)]
        owner: String,
        #[arg(long)]
        generation: u64,
    },
}

#[derive(Debug, clap::Subcommand)]
pub enum ImageCommand {
    /// Pull HOST[:PORT]/NAME[:TAG] (progress bar on a terminal).
    Pull {
        #[command(flatten)]
        conn: Conn,
        reference: String,
    },
    /// List stored images.
    Ls {
        #[command(flatten)]
        conn: Conn,
    },
    /// Remove an image; layers nothing uses any more are deleted.
    Rm {
        #[command(flatten)]
        conn: Conn,
        reference: String,
    },
    /// Import an OCI layout directory or a `docker save` archive.
    Import {
        #[command(flatten)]
        conn: Conn,
        path: PathBuf,
        /// Name for the image (required when the archive carries none).
        #[arg(long)]
        reference: Option<String>,
    },
}

struct Client {
    http: reqwest::blocking::Client,
    url: String,
    token: String,
}

impl Client {
    fn new(conn: &Conn) -> anyhow::Result<Client> {
        let token = match std::env::var("SBX_TOKEN") {
            Ok(t) if !t.is_empty() => t,
            _ => std::fs::read_to_string(&conn.token_file)
                .with_context(|| {
                    format!(
                        "read token {} (set SBX_TOKEN or --token-file)",
                        conn.token_file.display()
                    )
                })?
                .trim()
                .to_string(),
        };
        let http = reqwest::blocking::Client::builder().timeout(None).build()?;
        Ok(Client {
            http,
            url: conn.url.trim_end_matches('/').to_string(),
            token,
        })
    }

    fn req(&self, method: reqwest::Method, path: &str) -> reqwest::blocking::RequestBuilder {
        self.http
            .request(method, format!("{}{}", self.url, path))
            .bearer_auth(&self.token)
    }

    fn json(&self, rb: reqwest::blocking::RequestBuilder) -> anyhow::Result<Value> {
        let resp = rb.send()?;
        let status = resp.status();
        let body = resp.text()?;
        if !status.is_success() {
            bail!("{status}: {}", error_text(&body));
        }
        if body.is_empty() {
            return Ok(Value::Null);
        }
        Ok(serde_json::from_str(&body)?)
    }
}

fn error_text(body: &str) -> String {
    serde_json::from_str::<Value>(body)
        .ok()
        .and_then(|v| v["message"].as_str().map(str::to_string))
        .unwrap_or_else(|| body.to_string())
}

fn kv(list: &[String], what: &str) -> anyhow::Result<serde_json::Map<String, Value>> {
    let mut m = serde_json::Map::new();
    for item in list {
        let (k, v) = item
            .split_once('=')
            .with_context(|| format!("{what} {item:?} is not KEY=VALUE"))?;
        m.insert(k.to_string(), json!(v));
    }
    Ok(m)
}

/// Sets `body[key]` when the option is given.
fn put(body: &mut Value, key: &str, value: Option<impl serde::Serialize>) {
    if let Some(v) = value {
        body[key] = json!(v);
    }
}

fn cmd_value(cmd: &[String]) -> Value {
    if cmd.len() == 1 {
        json!(cmd[0])
    } else {
        json!(cmd)
    }
}

/// Streams an exec over SSE to our stdout/stderr; returns the exit code.
fn exec_stream(c: &Client, id: &str, body: Value) -> anyhow::Result<i32> {
    let resp = c
        .req(reqwest::Method::POST, &format!("/v1/runs/{id}/exec"))
        .header("accept", "text/event-stream")
        .json(&body)
        .send()?;
    if !resp.status().is_success() {
        let status = resp.status();
        bail!("{status}: {}", error_text(&resp.text()?));
    }
    let mut event = String::new();
    let (mut out, mut err) = (std::io::stdout(), std::io::stderr());
    for line in std::io::BufReader::new(resp).lines() {
        let line = line?;
        if let Some(e) = line.strip_prefix("event:") {
            event = e.trim().to_string();
        } else if let Some(d) = line.strip_prefix("data:") {
            let v: Value = serde_json::from_str(d.trim())?;
            let bytes = || -> Vec<u8> {
                let data = v["data"].as_str().unwrap_or_default();
                if v["encoding"] == "base64" {
                    base64::engine::general_purpose::STANDARD
                        .decode(data)
                        .unwrap_or_default()
                } else {
                    data.as_bytes().to_vec()
                }
            };
            match event.as_str() {
                "stdout" => {
                    out.write_all(&bytes())?;
                    out.flush()?;
                }
                "stderr" => {
                    err.write_all(&bytes())?;
                }
                "exit" => {
                    if v["timedOut"] == true {
                        eprintln!("sbx: command timed out");
                    }
                    return Ok(v["exitCode"].as_i64().unwrap_or(1) as i32);
                }
                _ => {}
            }
        }
    }
    bail!("the stream ended without an exit event")
}

fn lease_cmd(cmd: LeaseCommand) -> anyhow::Result<i32> {
    let (conn, id, path, body) = match cmd {
        LeaseCommand::Acquire {
            conn,
            id,
            owner,
            ttl,
        } => (conn, id, "lease", json!({"owner": owner, "ttlSec": ttl})),
        LeaseCommand::Renew {
            conn,
            id,
            owner,
            generation,
            ttl,
        } => (
            conn,
            id,
            "lease/renew",
            json!({"owner": owner, "generation": generation, "ttlSec": ttl}),
        ),
        LeaseCommand::Release {
            conn,
            id,
            owner,
            generation,
        } => (
            conn,
            id,
            "lease/release",
            json!({"owner": owner, "generation": generation}),
        ),
    };
    let c = Client::new(&conn)?;
    let v = c.json(
        c.req(reqwest::Method::POST, &format!("/v1/runs/{id}/{path}"))
            .json(&body),
    )?;
    if let Some(l) = v.get("lease") {
        println!(
            "generation {} held by {} until {}",
            l["generation"],
            l["holder"].as_str().unwrap_or_default(),
            l["expiresAt"].as_str().unwrap_or_default()
        );
    } else {
        println!("released");
    }
    Ok(0)
}

fn human(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}

fn image_cmd(cmd: ImageCommand) -> anyhow::Result<i32> {
    use std::io::IsTerminal;
    match cmd {
        ImageCommand::Pull { conn, reference } => {
            let c = Client::new(&conn)?;
            let resp = c
                .req(reqwest::Method::POST, "/v1/images/pull")
                .header("accept", "text/event-stream")
                .json(&json!({"reference": reference}))
                .send()?;
            if !resp.status().is_success() {
                let status = resp.status();
                bail!("{status}: {}", error_text(&resp.text()?));
            }
            let tty = std::io::stderr().is_terminal();
            let mut layers: std::collections::BTreeMap<String, (u64, u64)> = Default::default();
            let mut event = String::new();
            for line in std::io::BufReader::new(resp).lines() {
                let line = line?;
                if let Some(e) = line.strip_prefix("event:") {
                    event = e.trim().to_string();
                    continue;
                }
                let Some(d) = line.strip_prefix("data:") else {
                    continue;
                };
                let v: Value = serde_json::from_str(d.trim())?;
                match event.as_str() {
                    "progress" => {
                        let layer = v["layer"].as_str().unwrap_or_default().to_string();
                        layers.insert(
                            layer,
                            (
                                v["doneBytes"].as_u64().unwrap_or(0),
                                v["totalBytes"].as_u64().unwrap_or(0),
                            ),
                        );
                        if tty {
                            let (done, total) =
                                layers.values().fold((0, 0), |a, (d, t)| (a.0 + d, a.1 + t));
                            let pct = (done * 100).checked_div(total).unwrap_or(0);
                            let width = 30;
                            let filled = (pct as usize * width / 100).min(width);
                            eprint!(
                                "\r[{}{}] {pct:>3}% {} / {} ({} layers)",
                                "#".repeat(filled),
                                " ".repeat(width - filled),
                                human(done),
                                human(total),
                                layers.len()
                            );
                        }
                    }
                    "done" => {
                        if tty {
                            eprintln!();
                        }
                        println!(
                            "{} {}",
                            v["reference"].as_str().unwrap_or_default(),
                            v["digest"].as_str().unwrap_or_default()
                        );
                        return Ok(0);
                    }
                    "error" => {
                        if tty {
                            eprintln!();
                        }
                        bail!("{}", v["message"].as_str().unwrap_or("pull failed"));
                    }
                    _ => {}
                }
            }
            bail!("the pull stream ended without a result")
        }
        ImageCommand::Ls { conn } => {
            let c = Client::new(&conn)?;
            let v = c.json(c.req(reqwest::Method::GET, "/v1/images"))?;
            println!("{:<48}  {:<19}  SIZE", "REFERENCE", "DIGEST");
            for i in v["images"].as_array().cloned().unwrap_or_default() {
                let digest = i["digest"].as_str().unwrap_or("(built in)");
                println!(
                    "{:<48}  {:<19}  {}",
                    i["reference"].as_str().unwrap_or_default(),
                    &digest[..digest.len().min(19)],
                    i["sizeBytes"].as_u64().map(human).unwrap_or_default()
                );
            }
            Ok(0)
        }
        ImageCommand::Rm { conn, reference } => {
            let c = Client::new(&conn)?;
            let v = c.json(
                c.req(reqwest::Method::DELETE, "/v1/images")
                    .query(&[("ref", reference.as_str())]),
            )?;
            println!(
                "{reference} ({} layers freed)",
                v["removedLayers"].as_array().map(Vec::len).unwrap_or(0)
            );
            Ok(0)
        }
        ImageCommand::Import {
            conn,
            path,
            reference,
        } => {
            let c = Client::new(&conn)?;
            let abs =
                std::fs::canonicalize(&path).with_context(|| format!("{}", path.display()))?;
            let mut body = json!({"path": abs});
            put(&mut body, "reference", reference);
            let v = c.json(
                c.req(reqwest::Method::POST, "/v1/images/import")
                    .json(&body),
            )?;
            for i in v["images"].as_array().cloned().unwrap_or_default() {
                println!("{}", i["reference"].as_str().unwrap_or_default());
            }
            Ok(0)
        }
    }
}

pub fn run(cmd: ClientCommand) -> anyhow::Result<i32> {
    match cmd {
        ClientCommand::Image(c) => image_cmd(c),
        ClientCommand::Lease(c) => lease_cmd(c),
        ClientCommand::Run {
            conn,
            image,
            template,
            ttl,
            network,
            env,
            labels,
            cpu,
            memory_mb,
            pids,
            rm,
            cmd,
        } => {
            let c = Client::new(&conn)?;
            let mut body = json!({});
            put(&mut body, "image", image);
            put(&mut body, "template", template);
            put(&mut body, "ttlSec", ttl);
            put(&mut body, "network", network);
            if !env.is_empty() {
                body["env"] = Value::Object(kv(&env, "env")?);
            }
            if !labels.is_empty() {
                body["labels"] = Value::Object(kv(&labels, "label")?);
            }
            let mut limits = json!({});
            put(&mut limits, "cpu", cpu);
            put(&mut limits, "memoryMb", memory_mb);
            put(&mut limits, "pids", pids);
            if limits.as_object().is_some_and(|l| !l.is_empty()) {
                body["limits"] = limits;
            }
            let v = c.json(c.req(reqwest::Method::POST, "/v1/runs").json(&body))?;
            let id = v["id"].as_str().context("no id in reply")?.to_string();
            if cmd.is_empty() {
                println!("{id}");
                return Ok(0);
            }
            eprintln!("sbx: run {id}");
            let code = exec_stream(&c, &id, json!({"cmd": cmd_value(&cmd)}));
            if rm {
                c.json(c.req(reqwest::Method::DELETE, &format!("/v1/runs/{id}")))?;
            }
            code
        }
        ClientCommand::Exec {
            conn,
            id,
            timeout,
            env,
            cwd,
            owner,
            generation,
            cmd,
        } => {
            let c = Client::new(&conn)?;
            let mut body = json!({"cmd": cmd_value(&cmd)});
            put(&mut body, "timeoutSec", timeout);
            if !env.is_empty() {
                body["env"] = Value::Object(kv(&env, "env")?);
            }
            put(&mut body, "cwd", cwd);
            put(&mut body, "owner", owner);
            put(&mut body, "generation", generation);
            exec_stream(&c, &id, body)
        }
        ClientCommand::Ls {
            conn,
            status,
            json: as_json,
        } => {
            let c = Client::new(&conn)?;
            let path = match status {
                Some(s) => format!("/v1/runs?status={s}"),
                None => "/v1/runs".to_string(),
            };
            let v = c.json(c.req(reqwest::Method::GET, &path))?;
            if as_json {
                println!("{}", serde_json::to_string_pretty(&v)?);
                return Ok(0);
            }
            println!(
                "{:<26}  {:<8}  {:<16}  {:<8}  EXPIRES",
                "ID", "STATUS", "IMAGE", "NETWORK"
            );
            for r in v["runs"].as_array().cloned().unwrap_or_default() {
                println!(
                    "{:<26}  {:<8}  {:<16}  {:<8}  {}",
                    r["id"].as_str().unwrap_or(""),
                    r["status"].as_str().unwrap_or(""),
                    r["image"].as_str().unwrap_or(""),
                    r["network"].as_str().unwrap_or(""),
                    r["expiresAt"].as_str().unwrap_or("")
                );
            }
            Ok(0)
        }
        ClientCommand::Rm { conn, purge, ids } => {
            let c = Client::new(&conn)?;
            let mut code = 0;
            for id in ids {
                let q = if purge { "?purge=true" } else { "" };
                match c.json(c.req(reqwest::Method::DELETE, &format!("/v1/runs/{id}{q}"))) {
                    Ok(_) => println!("{id}"),
                    Err(e) => {
                        eprintln!("sbx: {id}: {e:#}");
                        code = 1;
                    }
                }
            }
            Ok(code)
        }
        ClientCommand::Cp { conn, src, dst } => {
            let c = Client::new(&conn)?;
            let remote = |s: &str| -> Option<(String, String)> {
                let (id, p) = s.split_once(':')?;
                ulid::Ulid::from_string(id).ok()?;
                Some((
                    id.to_string(),
                    p.trim_start_matches("/work/")
                        .trim_start_matches('/')
                        .to_string(),
                ))
            };
            match (remote(&src), remote(&dst)) {
                (None, Some((id, path))) => {
                    let mut data = Vec::new();
                    if src == "-" {
                        std::io::stdin().read_to_end(&mut data)?;
                    } else {
                        data = std::fs::read(&src).with_context(|| format!("read {src}"))?;
                    }
                    c.json(
                        c.req(reqwest::Method::PUT, &format!("/v1/runs/{id}/files/{path}"))
                            .body(data),
                    )?;
                    Ok(0)
                }
                (Some((id, path)), None) => {
                    let resp = c
                        .req(reqwest::Method::GET, &format!("/v1/runs/{id}/files/{path}"))
                        .send()?;
                    let status = resp.status();
                    let bytes = resp.bytes()?;
                    if !status.is_success() {
                        bail!("{status}: {}", error_text(&String::from_utf8_lossy(&bytes)));
                    }
                    if dst == "-" {
                        std::io::stdout().write_all(&bytes)?;
                    } else {
                        std::fs::write(&dst, &bytes).with_context(|| format!("write {dst}"))?;
                    }
                    Ok(0)
                }
                _ => bail!("exactly one of SRC and DST must be RUN-ID:PATH"),
            }
        }
    }
}
