//! The run registry: one task owns every run's state. API handlers send it
//! commands and await replies; slow work (creating a sandbox, tearing one
//! down) runs in tasks that report back, so the owner never blocks on it.

pub mod exec;
pub mod files;
pub mod model;
pub mod sandbox;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use serde_json::{json, Value};
use tokio::sync::{mpsc, oneshot};

pub use model::{parse_user, CreatePlan, Status};
use sandbox::{Host, Started};
use sbx_runtime::ShimState;

use crate::seal::Sealer;
use crate::store::Store;

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("run {0} not found")]
    NotFound(String),
    #[error("run {id} is {status}")]
    NotRunning { id: String, status: &'static str },
    #[error("{0}")]
    Unprocessable(String),
    #[error("{err}")]
    Lease {
        err: crate::leases::LeaseError,
        /// RFC 3339 expiry of the lease in force, for `held`.
        expires_at: Option<String>,
    },
    #[error("daemon is shutting down")]
    ShuttingDown,
    #[error("{0}")]
    Internal(String),
}

/// What an exec needs to enter a run.
#[derive(Debug, Clone)]
pub struct ExecTicket {
    pub id: String,
    pub init_pid: i32,
    pub init_start: u64,
    pub cgroup: String,
    pub uid: u32,
    pub gid: u32,
    pub workdir: String,
    pub base_env: Vec<(String, String)>,
}

/// What a file operation needs.
#[derive(Debug, Clone)]
pub struct FilesTicket {
    pub rootfs: std::path::PathBuf,
    pub uid: u32,
    pub gid: u32,
}

/// A lease credential presented with a write: owner and generation.
pub type Credential = (String, u64);

#[derive(Debug, Clone)]
pub enum LeaseOp {
    Acquire {
        owner: String,
        ttl_secs: u64,
    },
    Renew {
        owner: String,
        generation: u64,
        ttl_secs: u64,
    },
    Release {
        owner: String,
        generation: u64,
    },
}

#[derive(Debug, Clone, Default)]
pub struct ListFilter {
    pub status: Option<Status>,
    pub label: Option<(String, Option<String>)>,
}

pub(crate) enum Cmd {
    Create(Box<CreatePlan>, oneshot::Sender<Result<Value, RunError>>),
    /// A create ended: its outcome, and whether its first record was
    /// written (see `Cmd::Create`).
    Created(
        String,
        Result<Box<Started>, (u16, String)>,
        Result<(), RunError>,
        oneshot::Sender<Result<Value, RunError>>,
    ),
    Get(String, oneshot::Sender<Result<Value, RunError>>),
    List(ListFilter, oneshot::Sender<Vec<Value>>),
    Patch(String, u64, oneshot::Sender<Result<Value, RunError>>),
    Delete(String, bool, oneshot::Sender<Result<Value, RunError>>),
    Destroyed(String, bool, Option<String>),
    ExecBegin(
        String,
        Option<Credential>,
        oneshot::Sender<Result<ExecTicket, RunError>>,
    ),
    FilesBegin(
        String,
        Option<Option<Credential>>,
        oneshot::Sender<Result<FilesTicket, RunError>>,
    ),
    Lease(
        String,
        LeaseOp,
        oneshot::Sender<Result<Option<Value>, RunError>>,
    ),
    OpEnd(String),
    Tick,
    ShimExited(String, u64),
    ProxyStarted(String, tokio::task::JoinHandle<()>),
    Shutdown(bool, oneshot::Sender<()>),
}

/// Cloneable handle to the registry task.
#[derive(Clone)]
pub struct Runs {
    tx: mpsc::Sender<Cmd>,
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct Record {
    id: String,
    status: Status,
    image: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    template: Option<String>,
    network: String,
    limits: sbx_runtime::Limits,
    labels: BTreeMap<String, String>,
    uid: u32,
    gid: u32,
    workdir: String,
    created_ms: i64,
    expires_ms: i64,
    ended_ms: Option<i64>,
    error: Option<String>,
    /// Names of create-time env vars (values are sealed, never shown).
    env_names: Vec<String>,
    /// The image's own environment (PATH and friends), under the run's.
    #[serde(default)]
    image_env: Vec<(String, String)>,
    /// Address, tier and proxy port of a networked run.
    #[serde(default)]
    net: Option<crate::network::RunNet>,
}

struct Entry {
    rec: Record,
    env: Vec<(String, String)>,
    shim: Option<ShimState>,
    /// Execs and file writes under way (acquire is `busy` while > 0).
    in_flight: u32,
    lease: crate::leases::LeaseState,
    /// The run's egress proxy task (allowlist tier).
    proxy: Option<tokio::task::JoinHandle<()>>,
}

fn db(store: &std::sync::Mutex<Store>) -> std::sync::MutexGuard<'_, Store> {
    store.lock().unwrap_or_else(|e| e.into_inner())
}

/// Writes a run's record (`event`: a history entry, when given); a run
/// that is no longer live loses its stored env.
fn write_record(
    db: &mut Store,
    id: &str,
    status: Status,
    record: &Value,
    sealed_env: Option<&[u8]>,
    event: Option<&str>,
) -> Result<(), RunError> {
    db.put_run(
        id,
        status.as_str(),
        record,
        sealed_env,
        event.map(|e| (e, now_ms())),
    )
    .map_err(|e| RunError::Internal(format!("{:#}", anyhow::Error::from(e))))?;
    if !status.is_live() {
        let _ = db.drop_env(id);
    }
    Ok(())
}

pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

pub fn rfc3339(ms: i64) -> String {
    time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000)
        .ok()
        .and_then(|t| {
            t.format(&time::format_description::well_known::Rfc3339)
                .ok()
        })
        .unwrap_or_default()
}

struct Registry {
    host: Arc<Host>,
    server: String,
    /// Shared with a create's task, which writes the run's first record
    /// while it lays the run out (see `Cmd::Create`).
    store: Arc<std::sync::Mutex<Store>>,
    sealer: Sealer,
    runs: HashMap<String, Entry>,
    tx: mpsc::Sender<Cmd>,
    images: Arc<crate::imagesvc::Images>,
    /// The network tiers, or why they are unavailable.
    net: Result<Arc<crate::network::Network>, String>,
    shutting_down: bool,
}

impl Registry {
    fn view(&self, e: &Entry) -> Value {
        let r = &e.rec;
        let mut v = json!({
            "id": r.id,
            "server": self.server,
            "status": r.status,
            "image": r.image,
            "network": r.network,
            "limits": {
                "cpu": f64::from(r.limits.cpu_millis) / 1000.0,
                "memoryMb": r.limits.memory_bytes >> 20,
                "pids": r.limits.pids,
            },
            "labels": r.labels,
            "user": format!("{}:{}", r.uid, r.gid),
            "workdir": r.workdir,
            "createdAt": rfc3339(r.created_ms),
            "expiresAt": rfc3339(r.expires_ms),
            "env": r.env_names,
            "lease": lease_view(e),
        });
        if let Some(t) = &r.template {
            v["template"] = json!(t);
        }
        if let Some(n) = &r.net {
            v["address"] = json!(n.ip.to_string());
            if let Ok(net) = &self.net {
                // The host end of the run's link, for whoever debugs the host.
                v["link"] = json!(net.names.veth(&n.slot));
                if let Some(url) = net.proxy_url(n) {
                    v["proxy"] = json!(url);
                }
            }
            if !n.egress_allow.is_empty() {
                v["egressAllow"] = json!(n.egress_allow);
            }
        }
        if let Some(ms) = r.ended_ms {
            v["endedAt"] = json!(rfc3339(ms));
        }
        if let Some(err) = &r.error {
            v["error"] = json!(err);
        }
        v
    }

    fn db(&self) -> std::sync::MutexGuard<'_, Store> {
        db(&self.store)
    }

    /// What the database keeps of run `id`: its status and record.
    fn record_of(&self, id: &str) -> Option<Result<(Status, Value), RunError>> {
        let e = self.runs.get(id)?;
        let rec = match serde_json::to_value(&e.rec) {
            Ok(r) => r,
            Err(err) => return Some(Err(RunError::Internal(err.to_string()))),
        };
        let mut record = json!({"rec": rec, "lease": e.lease});
        if let Some(s) = e.shim {
            record["shim"] = serde_json::to_value(s).unwrap_or(Value::Null);
        }
        Some(Ok((e.rec.status, record)))
    }

    /// Writes run `id`'s record with a history `event` (None: none).
    fn persist_event(
        &mut self,
        id: &str,
        sealed_env: Option<Vec<u8>>,
        event: Option<&str>,
    ) -> Result<(), RunError> {
        let Some(found) = self.record_of(id) else {
            return Ok(());
        };
        let (status, record) = found?;
        write_record(
            &mut self.db(),
            id,
            status,
            &record,
            sealed_env.as_deref(),
            event,
        )
    }

    fn persist(
        &mut self,
        id: &str,
        sealed_env: Option<Vec<u8>>,
        event: &str,
    ) -> Result<(), RunError> {
        self.persist_event(id, sealed_env, Some(event))
    }

    fn set_status(&mut self, id: &str, status: Status, error: Option<String>) {
        if let Some(e) = self.runs.get_mut(id) {
            e.rec.status = status;
            if !status.is_live() && e.rec.ended_ms.is_none() {
                e.rec.ended_ms = Some(now_ms());
            }
            if error.is_some() {
                e.rec.error = error.clone();
            }
            e.env.clear();
        }
        if let Err(e) = self.persist(id, None, error.as_deref().unwrap_or("")) {
            tracing::error!(run = id, error = %e, "persist status");
        }
    }

    fn spawn_destroy(
        &mut self,
        id: String,
        purge: bool,
        reply: Option<oneshot::Sender<Result<Value, RunError>>>,
    ) {
        let host = self.host.clone();
        let tx = self.tx.clone();
        let (proxy, run_net) = match self.runs.get_mut(&id) {
            Some(e) => (e.proxy.take(), e.rec.net.clone()),
            None => (None, None),
        };
        if let Some(p) = proxy {
            p.abort();
        }
        let net = self.net.clone().ok().zip(run_net);
        tokio::spawn(async move {
            let i = id.clone();
            let res = tokio::task::spawn_blocking(move || sandbox::destroy(&host, &i)).await;
            // Its processes are gone: the namespace, link and address go too.
            if let Some((n, rn)) = net {
                n.release(&rn).await;
            }
            let err = match res {
                Ok(Ok(())) => None,
                Ok(Err(e)) => Some(format!("{:#}", anyhow::Error::from(e))),
                Err(e) => Some(e.to_string()),
            };
            if let Some(e) = &err {
                tracing::error!(run = %id, error = %e, "teardown");
            }
            let _ = tx.send(Cmd::Destroyed(id.clone(), purge, err)).await;
            if let Some(reply) = reply {
                // The registry answers after recording the teardown.
                let _ = reply.send(Ok(json!({"id": id})));
            }
        });
    }

    fn watch(&self, id: String, shim: ShimState) {
        let tx = self.tx.clone();
        tokio::spawn(async move {
            wait_pid_exit(shim.shim_pid, shim.shim_start).await;
            let _ = tx.send(Cmd::ShimExited(id, shim.shim_start)).await;
        });
    }

    fn lease_op(&mut self, id: &str, op: LeaseOp) -> Result<Option<Value>, RunError> {
        use crate::leases::mono_now_ms;
        let e = self
            .runs
            .get_mut(id)
            .ok_or_else(|| RunError::NotFound(id.to_string()))?;
        if e.rec.status != Status::Running {
            return Err(RunError::NotRunning {
                id: id.to_string(),
                status: e.rec.status.as_str(),
            });
        }
        let now = mono_now_ms();
        let before = e.lease.clone();
        let result = match &op {
            LeaseOp::Acquire { owner, ttl_secs } => e
                .lease
                .acquire(owner, ttl_secs * 1000, now, e.in_flight)
                .map(Some),
            LeaseOp::Renew {
                owner,
                generation,
                ttl_secs,
            } => e
                .lease
                .renew(owner, *generation, ttl_secs * 1000, now)
                .map(Some),
            LeaseOp::Release { owner, generation } => {
                e.lease.release(owner, *generation, now).map(|()| None)
            }
        };
        let result = result.map_err(|err| lease_error(err, now));
        let granted = result.as_ref().ok().cloned().flatten();
        let view = lease_view(e);
        if result.is_ok() {
            let event = match &op {
                LeaseOp::Acquire { owner, .. } => format!("lease granted to {owner}"),
                LeaseOp::Renew { owner, .. } => format!("lease renewed by {owner}"),
                LeaseOp::Release { owner, .. } => format!("lease released by {owner}"),
            };
            // The generation is the fencing token: on disk before anyone hears of it.
            if let Err(err) = self.persist(id, None, &event) {
                if let Some(e) = self.runs.get_mut(id) {
                    e.lease = before;
                }
                return Err(err);
            }
        }
        result.map(|_| granted.map(|_| view))
    }

    fn handle(&mut self, cmd: Cmd) {
        match cmd {
            Cmd::Create(plan, reply) => {
                if self.shutting_down {
                    let _ = reply.send(Err(RunError::ShuttingDown));
                    return;
                }
                let id = ulid::Ulid::new().to_string();
                if let (Some(_), Err(why)) = (model::tier_of(&plan.network), &self.net) {
                    let msg = format!("network {}: unavailable on this host: {why}", plan.network);
                    let _ = reply.send(Err(RunError::Unprocessable(msg)));
                    return;
                }
                let now = now_ms();
                let env_json = serde_json::to_vec(&plan.env).unwrap_or_default();
                let rec = Record {
                    id: id.clone(),
                    status: Status::Creating,
                    image: plan.image.clone(),
                    template: plan.template.clone(),
                    network: plan.network.clone(),
                    limits: plan.limits,
                    labels: plan.labels.clone(),
                    uid: plan.uid,
                    gid: plan.gid,
                    workdir: plan.workdir.clone(),
                    created_ms: now,
                    expires_ms: now + (plan.ttl_secs as i64) * 1000,
                    ended_ms: None,
                    error: None,
                    env_names: plan.env.iter().map(|(k, _)| k.clone()).collect(),
                    image_env: Vec::new(),
                    net: None,
                };
                self.runs.insert(
                    id.clone(),
                    Entry {
                        rec,
                        env: plan.env.clone(),
                        shim: None,
                        in_flight: 0,
                        lease: Default::default(),
                        proxy: None,
                    },
                );
                let sealed = self.sealer.seal(&env_json);
                // The first record is written by the create's task, on a
                // blocking thread, while it lays the run out; the reply
                // waits for it (see `Created`).
                let first = match self.record_of(&id) {
                    Some(Ok(r)) => r,
                    Some(Err(e)) => {
                        self.runs.remove(&id);
                        let _ = reply.send(Err(e));
                        return;
                    }
                    None => return,
                };
                let store = self.store.clone();
                let host = self.host.clone();
                let images = self.images.clone();
                let net = self.net.clone().ok();
                let tx = self.tx.clone();
                tokio::spawn(async move {
                    let rid = id.clone();
                    let recorded = tokio::task::spawn_blocking(move || {
                        let (status, record) = first;
                        write_record(
                            &mut db(&store),
                            &rid,
                            status,
                            &record,
                            Some(&sealed),
                            Some(""),
                        )
                    });
                    let result = async {
                        let root = images
                            .root_for(&plan.image)
                            .await
                            .map_err(|e| (422u16, e))?;
                        let run_net = match (&net, model::tier_of(&plan.network)) {
                            (Some(n), Some(tier)) => {
                                Some(n.take(tier, plan.egress_allow.clone()).await.map_err(
                                    |e| (500u16, format!("network: {:#}", anyhow::Error::from(e))),
                                )?)
                            }
                            _ => None,
                        };
                        // A `none` run joins a ready loopback-only namespace
                        // when one waits; its pin goes once the run is up.
                        let loner = match (&net, &run_net) {
                            (Some(n), None) => n.take_loopback_only(),
                            _ => None,
                        };
                        let netns = net
                            .as_ref()
                            .zip(run_net.as_ref())
                            .map(|(n, rn)| n.netns_path(&rn.slot))
                            .or_else(|| loner.clone());
                        let created = sandbox::create(&host, &id, &plan, root, netns).await;
                        if let Some(n) = &net {
                            n.created(run_net.as_ref().map(|rn| rn.tier), loner);
                        }
                        let created = created.map(Box::new).map_err(|e| {
                            // An unusable image is the client's problem, the rest ours.
                            let code = if matches!(e, sandbox::SandboxError::Image(_)) {
                                422u16
                            } else {
                                500
                            };
                            (code, format!("{:#}", anyhow::Error::from(e)))
                        });
                        let mut started = match created {
                            Ok(s) => s,
                            Err(e) => {
                                if let (Some(n), Some(rn)) = (&net, &run_net) {
                                    n.release(rn).await;
                                }
                                return Err(e);
                            }
                        };
                        if let (Some(n), Some(rn)) = (&net, &run_net) {
                            if rn.proxy_port.is_some() {
                                match n.start_proxy(&id, rn).await {
                                    Ok(h) => started.proxy = Some(h),
                                    Err(e) => {
                                        let (h, i) = (host.clone(), id.clone());
                                        let _ = tokio::task::spawn_blocking(move || {
                                            sandbox::destroy(&h, &i)
                                        })
                                        .await;
                                        n.release(rn).await;
                                        return Err((
                                            500u16,
                                            format!("network: {:#}", anyhow::Error::from(e)),
                                        ));
                                    }
                                }
                            }
                        }
                        started.net = run_net;
                        Ok(started)
                    }
                    .await;
                    let recorded = recorded
                        .await
                        .unwrap_or_else(|e| Err(RunError::Internal(e.to_string())));
                    let _ = tx.send(Cmd::Created(id, result, recorded, reply)).await;
                });
            }
            Cmd::Created(id, result, recorded, reply) => {
                let status = self.runs.get(&id).map(|e| e.rec.status);
                match (result, status, recorded) {
                    (Ok(started), Some(Status::Creating), Ok(())) => {
                        let shim = started.shim;
                        if let Some(e) = self.runs.get_mut(&id) {
                            e.shim = Some(shim);
                            e.rec.status = Status::Running;
                            e.rec.image_env = started.image_env;
                            e.rec.net = started.net;
                            e.proxy = started.proxy;
                        }
                        let persisted = self.persist(&id, None, "");
                        self.watch(id.clone(), shim);
                        match persisted {
                            Ok(()) => {
                                tracing::info!(run = %id, "run created");
                                let v = self.runs.get(&id).map(|e| self.view(e));
                                let _ = reply.send(v.ok_or(RunError::NotFound(id)));
                            }
                            Err(e) => {
                                self.set_status(
                                    &id,
                                    Status::Error,
                                    Some("could not record the run".into()),
                                );
                                self.spawn_destroy(id, false, None);
                                let _ = reply.send(Err(e));
                            }
                        }
                    }
                    (Ok(started), _, recorded) => {
                        // Up, but not to be kept: whatever the create made goes.
                        let mut started = *started;
                        if let Some(p) = started.proxy.take() {
                            p.abort();
                        }
                        if let Some(e) = self.runs.get_mut(&id) {
                            e.rec.net = started.net.take();
                        }
                        // Not in the database: forgotten once torn down,
                        // as a create whose record failed was before the
                        // record moved beside the layout.
                        let purge = recorded.is_err();
                        let why = match recorded {
                            Err(why) => why,
                            // Deleted while it was being created. The first
                            // record may have landed after the delete's:
                            // write the run's state again (no history event).
                            Ok(()) => {
                                if let Err(e) = self.persist_event(&id, None, None) {
                                    tracing::error!(run = %id, error = %e, "record the run");
                                }
                                RunError::NotRunning {
                                    id: id.clone(),
                                    status: "killed",
                                }
                            }
                        };
                        self.spawn_destroy(id, purge, None);
                        let _ = reply.send(Err(why));
                    }
                    (Err(_), _, Err(why)) => {
                        // Neither made nor recorded.
                        self.runs.remove(&id);
                        let _ = reply.send(Err(why));
                    }
                    (Err((code, msg)), _, Ok(())) => {
                        tracing::warn!(run = %id, error = %msg, "create failed");
                        self.set_status(&id, Status::Error, Some(msg.clone()));
                        let _ = reply.send(Err(if code == 422 {
                            RunError::Unprocessable(msg)
                        } else {
                            RunError::Internal(msg)
                        }));
                    }
                }
            }
            Cmd::Get(id, reply) => {
                let v = self.runs.get(&id).map(|e| {
                    let mut v = self.view(e);
                    let history: Vec<Value> = self
                        .db()
                        .history(&id)
                        .unwrap_or_default()
                        .into_iter()
                        .map(|(status, at, msg)| {
                            let mut h = json!({"status": status, "at": rfc3339(at)});
                            if let Some(m) = msg.filter(|m| !m.is_empty()) {
                                h["message"] = json!(m);
                            }
                            h
                        })
                        .collect();
                    v["history"] = json!(history);
                    v
                });
                let _ = reply.send(v.ok_or(RunError::NotFound(id)));
            }
            Cmd::List(filter, reply) => {
                let mut ids: Vec<&String> = self.runs.keys().collect();
                ids.sort();
                let out = ids
                    .into_iter()
                    .filter_map(|id| self.runs.get(id))
                    .filter(|e| filter.status.is_none_or(|s| e.rec.status == s))
                    .filter(|e| match &filter.label {
                        None => true,
                        Some((k, None)) => e.rec.labels.contains_key(k),
                        Some((k, Some(v))) => e.rec.labels.get(k) == Some(v),
                    })
                    .map(|e| self.view(e))
                    .collect();
                let _ = reply.send(out);
            }
            Cmd::Patch(id, ttl, reply) => {
                let r = match self.runs.get_mut(&id) {
                    None => Err(RunError::NotFound(id.clone())),
                    Some(e) if !e.rec.status.is_live() => Err(RunError::NotRunning {
                        id: id.clone(),
                        status: e.rec.status.as_str(),
                    }),
                    Some(e) => {
                        e.rec.expires_ms = now_ms() + (ttl as i64) * 1000;
                        Ok(())
                    }
                };
                let r = r.and_then(|()| self.persist(&id, None, "ttl changed"));
                let _ = reply
                    .send(r.map(|()| self.runs.get(&id).map(|e| self.view(e)).unwrap_or_default()));
            }
            Cmd::Delete(id, purge, reply) => {
                let Some(e) = self.runs.get(&id) else {
                    let _ = reply.send(Err(RunError::NotFound(id)));
                    return;
                };
                match e.rec.status {
                    Status::Running => {
                        self.set_status(&id, Status::Killed, None);
                        tracing::info!(run = %id, "run killed");
                        self.spawn_destroy(id, purge, Some(reply));
                    }
                    Status::Creating => {
                        self.set_status(&id, Status::Killed, None);
                        let v = self.runs.get(&id).map(|e| self.view(e)).unwrap_or_default();
                        let _ = reply.send(Ok(v));
                    }
                    _ => {
                        if purge {
                            // Make sure nothing of it is left, then forget it.
                            self.spawn_destroy(id, true, Some(reply));
                        } else {
                            let v = self.view(e);
                            let _ = reply.send(Ok(v));
                        }
                    }
                }
            }
            Cmd::Destroyed(id, purge, err) => {
                if let Some(msg) = err {
                    if let Some(e) = self.runs.get_mut(&id) {
                        e.rec.error = Some(format!("teardown: {msg}"));
                    }
                    let _ = self.persist(&id, None, "teardown failed");
                } else if purge {
                    self.runs.remove(&id);
                    if let Err(e) = self.db().delete_run(&id) {
                        tracing::error!(run = %id, error = %e, "purge");
                    }
                }
            }
            Cmd::ExecBegin(id, cred, reply) => {
                let r = match self.runs.get_mut(&id) {
                    None => Err(RunError::NotFound(id)),
                    Some(e) => match (e.rec.status, e.shim) {
                        (Status::Running, Some(s)) => fence(e, cred.as_ref()).map(|()| {
                            e.in_flight += 1;
                            let mut base_env = vec![
                                (
                                    "PATH".to_string(),
                                    sbx_runtime::spec::DEFAULT_PATH.to_string(),
                                ),
                                ("HOSTNAME".to_string(), id.clone()),
                            ];
                            base_env.extend(e.rec.image_env.iter().cloned());
                            base_env.push(("HOME".to_string(), "/work".to_string()));
                            if let (Some(rn), Ok(n)) = (&e.rec.net, &self.net) {
                                base_env.extend(n.proxy_env(rn));
                            }
                            base_env.extend(e.env.iter().cloned());
                            let base_env = dedup_env(base_env);
                            ExecTicket {
                                cgroup: format!(
                                    "{}/exec-{}",
                                    self.host.cgroup(&id),
                                    ulid::Ulid::new()
                                ),
                                id,
                                init_pid: s.init_pid,
                                init_start: s.init_start,
                                uid: e.rec.uid,
                                gid: e.rec.gid,
                                workdir: e.rec.workdir.clone(),
                                base_env,
                            }
                        }),
                        (status, _) => Err(RunError::NotRunning {
                            id,
                            status: status.as_str(),
                        }),
                    },
                };
                let _ = reply.send(r);
            }
            Cmd::FilesBegin(id, write, reply) => {
                let r = match self.runs.get_mut(&id) {
                    None => Err(RunError::NotFound(id)),
                    Some(e) if e.rec.status == Status::Running => {
                        let fenced = match &write {
                            Some(cred) => fence(e, cred.as_ref()),
                            None => Ok(()),
                        };
                        fenced.map(|()| {
                            if write.is_some() {
                                e.in_flight += 1;
                            }
                            FilesTicket {
                                rootfs: self.host.paths(&id).rootfs(),
                                uid: e.rec.uid,
                                gid: e.rec.gid,
                            }
                        })
                    }
                    Some(e) => Err(RunError::NotRunning {
                        id,
                        status: e.rec.status.as_str(),
                    }),
                };
                let _ = reply.send(r);
            }
            Cmd::Lease(id, op, reply) => {
                let r = self.lease_op(&id, op);
                let _ = reply.send(r);
            }
            Cmd::OpEnd(id) => {
                if let Some(e) = self.runs.get_mut(&id) {
                    e.in_flight = e.in_flight.saturating_sub(1);
                }
            }
            Cmd::ProxyStarted(id, handle) => match self.runs.get_mut(&id) {
                Some(e) if e.rec.status == Status::Running => e.proxy = Some(handle),
                _ => handle.abort(),
            },
            Cmd::Tick => {
                let now = now_ms();
                let expired: Vec<String> = self
                    .runs
                    .values()
                    .filter(|e| e.rec.status == Status::Running && e.rec.expires_ms <= now)
                    .map(|e| e.rec.id.clone())
                    .collect();
                for id in expired {
                    tracing::info!(run = %id, "run expired");
                    self.set_status(&id, Status::Expired, None);
                    self.spawn_destroy(id, false, None);
                }
            }
            Cmd::ShimExited(id, shim_start) => {
                let live = self.runs.get(&id).is_some_and(|e| {
                    e.rec.status == Status::Running
                        && e.shim.map(|s| s.shim_start) == Some(shim_start)
                });
                if live && !self.shutting_down {
                    tracing::warn!(run = %id, "sandbox exited on its own");
                    self.set_status(
                        &id,
                        Status::Error,
                        Some("sandbox exited unexpectedly".into()),
                    );
                    self.spawn_destroy(id, false, None);
                }
            }
            Cmd::Shutdown(stop_runs, reply) => {
                self.shutting_down = true;
                self.host.spares.close();
                if stop_runs {
                    let live: Vec<String> = self
                        .runs
                        .values()
                        .filter(|e| e.rec.status.is_live())
                        .map(|e| e.rec.id.clone())
                        .collect();
                    let host = self.host.clone();
                    let net = self.net.clone().ok();
                    for id in &live {
                        self.set_status(
                            id,
                            Status::Killed,
                            Some("daemon stopped with --stop-runs-on-exit".into()),
                        );
                    }
                    tokio::spawn(async move {
                        let _ = tokio::task::spawn_blocking(move || {
                            for id in live {
                                if let Err(e) = sandbox::destroy(&host, &id) {
                                    tracing::error!(run = %id, error = %e, "teardown on exit");
                                }
                            }
                        })
                        .await;
                        if let Some(n) = net {
                            // Every run is gone: so are their links, and the bridges.
                            n.reconcile(&[]).await;
                            n.drain_pool().await;
                            n.teardown().await;
                        }
                        let _ = reply.send(());
                    });
                } else if let Ok(n) = self.net.clone() {
                    // Runs stay for the next start; the ready pool does not.
                    tokio::spawn(async move {
                        n.drain_pool().await;
                        let _ = reply.send(());
                    });
                } else {
                    let _ = reply.send(());
                }
            }
        }
    }

    /// Start-up reconciliation: re-adopt live runs, mark vanished ones
    /// `error`, remove everything of this daemon's that has no live record.
    fn reconcile(&mut self) -> Result<(), RunError> {
        let stored = self
            .db()
            .load_runs()
            .map_err(|e| RunError::Internal(e.to_string()))?;
        let mut adopted = Vec::new();
        let mut gone = Vec::new();
        for s in stored {
            let Ok(rec) = serde_json::from_value::<Record>(s.record["rec"].clone()) else {
                tracing::error!(record = %s.record, "unreadable run record skipped");
                continue;
            };
            let shim: Option<ShimState> = serde_json::from_value(s.record["shim"].clone())
                .ok()
                .or_else(|| ShimState::load(&self.host.paths(&rec.id)).ok());
            let id = rec.id.clone();
            let live =
                rec.status.is_live() && shim.is_some_and(|s| s.init_alive() && s.shim_alive());
            let env = if live {
                s.env_sealed
                    .as_deref()
                    .and_then(|b| self.sealer.open(b).ok())
                    .and_then(|b| serde_json::from_slice::<Vec<(String, String)>>(&b).ok())
                    .unwrap_or_default()
            } else {
                Vec::new()
            };
            let was_live = rec.status.is_live();
            let lease = serde_json::from_value(s.record["lease"].clone()).unwrap_or_default();
            self.runs.insert(
                id.clone(),
                Entry {
                    rec,
                    env,
                    shim,
                    in_flight: 0,
                    lease,
                    proxy: None,
                },
            );
            if live {
                if let Some(e) = self.runs.get_mut(&id) {
                    e.rec.status = Status::Running;
                }
                adopted.push(id);
            } else if was_live {
                gone.push(id);
            }
        }
        for id in &gone {
            tracing::warn!(run = %id, "sandbox gone after restart");
            self.set_status(
                id,
                Status::Error,
                Some("sandbox was gone after a daemon restart".into()),
            );
        }
        for id in &adopted {
            if let Some(s) = self.runs.get(id).and_then(|e| e.shim) {
                tracing::info!(run = %id, "re-adopted run");
                self.watch(id.clone(), s);
            }
            let rn = self.runs.get(id).and_then(|e| e.rec.net.clone());
            if let (Some(rn), Ok(n)) = (rn.filter(|r| r.proxy_port.is_some()), &self.net) {
                let (n, id, tx) = (n.clone(), id.clone(), self.tx.clone());
                tokio::spawn(async move {
                    match n.start_proxy(&id, &rn).await {
                        Ok(h) => {
                            let _ = tx.send(Cmd::ProxyStarted(id, h)).await;
                        }
                        Err(e) => {
                            tracing::error!(run = %id, error = %format!("{:#}", anyhow::Error::from(e)), "restart egress proxy")
                        }
                    }
                });
            }
        }
        if let Ok(n) = &self.net {
            let nets: Vec<crate::network::RunNet> = adopted
                .iter()
                .filter_map(|id| self.runs.get(id).and_then(|e| e.rec.net.clone()))
                .collect();
            n.adopt(&nets);
            let n = n.clone();
            tokio::spawn(async move { n.reconcile(&nets).await });
        }
        // Everything on disk, in cgroups or in the process table that no
        // live record owns is an orphan.
        let live: std::collections::HashSet<String> = adopted.into_iter().collect();
        let mut orphans: std::collections::BTreeSet<String> = std::collections::BTreeSet::new();
        if let Ok(rd) = std::fs::read_dir(self.host.runs_dir()) {
            for e in rd.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if name.starts_with(sandbox::SPARE_PREFIX) {
                    // A stopped daemon's spare run directory (empty).
                    let _ = std::fs::remove_dir(e.path());
                } else {
                    orphans.insert(name);
                }
            }
        }
        orphans.extend(sbx_runtime::cgroups::children(
            &self.host.layout,
            &self.host.cgroup_parent,
        ));
        orphans.extend(
            sandbox::find_shims(&self.host.runs_dir())
                .into_iter()
                .map(|(_, id)| id),
        );
        orphans.retain(|id| !live.contains(id));
        for id in orphans {
            tracing::info!(run = %id, "removing orphan");
            if let Err(e) = sandbox::destroy(&self.host, &id) {
                tracing::error!(run = %id, error = %format!("{:#}", anyhow::Error::from(e)), "orphan teardown");
            }
        }
        Ok(())
    }
}

/// `{holder, generation, expiresAt}` of the lease in force, or null.
fn lease_view(e: &Entry) -> Value {
    let now_mono = crate::leases::mono_now_ms();
    let mut st = e.lease.clone();
    match st.active(now_mono) {
        Some(l) if e.rec.status == Status::Running => json!({
            "holder": l.holder,
            "generation": l.generation,
            "expiresAt": rfc3339(now_ms() + (l.expires_mono_ms.saturating_sub(now_mono)) as i64),
        }),
        _ => Value::Null,
    }
}

fn lease_error(err: crate::leases::LeaseError, now_mono: u64) -> RunError {
    let expires_at = match &err {
        crate::leases::LeaseError::Held {
            expires_mono_ms, ..
        } => Some(rfc3339(
            now_ms() + expires_mono_ms.saturating_sub(now_mono) as i64,
        )),
        _ => None,
    };
    RunError::Lease { err, expires_at }
}

/// Fencing for a write (exec or file PUT).
fn fence(e: &mut Entry, cred: Option<&Credential>) -> Result<(), RunError> {
    let now = crate::leases::mono_now_ms();
    e.lease
        .check_write(cred.map(|(o, g)| (o.as_str(), *g)), now)
        .map_err(|err| lease_error(err, now))
}

/// Later entries win; order of first appearance is kept.
fn dedup_env(env: Vec<(String, String)>) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = Vec::new();
    for (k, v) in env {
        match out.iter_mut().find(|(ok, _)| *ok == k) {
            Some(slot) => slot.1 = v,
            None => out.push((k, v)),
        }
    }
    out
}

/// Resolves when the process `pid` (started at `start`) has exited.
/// Returns once process `pid` (started at `start`) has ended: at once
/// through a pidfd, polling only if pidfds are unavailable.
#[allow(unsafe_code)]
async fn wait_pid_exit(pid: i32, start: u64) {
    let pidfd = rustix::process::Pid::from_raw(pid)
        .and_then(|p| rustix::process::pidfd_open(p, rustix::process::PidfdFlags::empty()).ok());
    // Checked after opening: the pidfd pins this process, not a later one.
    if !sbx_runtime::alive(pid, start) {
        return;
    }
    if let Some(fd) = pidfd {
        // SAFETY: the AsyncFd owns the OwnedFd, so the descriptor stays open
        // and the same for the AsyncFd's whole life.
        let registered = unsafe {
            tokio::io::unix::AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE)
        };
        if let Ok(afd) = registered {
            let _ = afd.readable().await;
            return;
        }
    }
    loop {
        if !sbx_runtime::alive(pid, start) {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    }
}

impl Runs {
    /// A handle whose registry is the receiver of `tx` (tests drive it by hand).
    #[cfg(test)]
    pub(crate) fn detached(tx: mpsc::Sender<Cmd>) -> Runs {
        Runs { tx }
    }

    /// Opens the store, reconciles with the kernel and starts the owner task.
    pub fn start(
        host: Arc<Host>,
        server: String,
        images: Arc<crate::imagesvc::Images>,
        net: Result<Arc<crate::network::Network>, String>,
    ) -> anyhow::Result<Runs> {
        std::fs::create_dir_all(host.runs_dir())?;
        // Each run's writable layer in a block group of its own (see there).
        sbx_images::store::spread_subdirectories(&host.runs_dir());
        let store = Store::open(&host.state_dir.join("sbx.db"))?;
        let sealer = Sealer::load_or_create(&host.state_dir.join("env.key"))?;
        let (tx, mut rx) = mpsc::channel(1024);
        let mut reg = Registry {
            host,
            server,
            store: Arc::new(std::sync::Mutex::new(store)),
            sealer,
            runs: HashMap::new(),
            tx: tx.clone(),
            images,
            net,
            shutting_down: false,
        };
        reg.reconcile()?;
        reg.host.spares.fill();
        tokio::spawn(async move {
            while let Some(cmd) = rx.recv().await {
                reg.handle(cmd);
            }
        });
        Ok(Runs { tx })
    }

    async fn ask<T>(&self, make: impl FnOnce(oneshot::Sender<T>) -> Cmd) -> Result<T, RunError> {
        let (tx, rx) = oneshot::channel();
        self.tx
            .send(make(tx))
            .await
            .map_err(|_| RunError::ShuttingDown)?;
        rx.await.map_err(|_| RunError::ShuttingDown)
    }

    pub async fn create(&self, plan: CreatePlan) -> Result<Value, RunError> {
        self.ask(|r| Cmd::Create(Box::new(plan), r)).await?
    }
    pub async fn get(&self, id: &str) -> Result<Value, RunError> {
        self.ask(|r| Cmd::Get(id.to_string(), r)).await?
    }
    pub async fn list(&self, filter: ListFilter) -> Result<Vec<Value>, RunError> {
        self.ask(|r| Cmd::List(filter, r)).await
    }
    pub async fn patch_ttl(&self, id: &str, ttl_secs: u64) -> Result<Value, RunError> {
        self.ask(|r| Cmd::Patch(id.to_string(), ttl_secs, r))
            .await?
    }
    /// Kills the run and returns once it is torn down.
    pub async fn delete(&self, id: &str, purge: bool) -> Result<(), RunError> {
        self.ask(|r| Cmd::Delete(id.to_string(), purge, r))
            .await?
            .map(|_| ())
    }
    /// Admits an exec (fenced by the lease) and counts it in flight.
    pub async fn exec_begin(
        &self,
        id: &str,
        cred: Option<Credential>,
    ) -> Result<ExecTicket, RunError> {
        self.ask(|r| Cmd::ExecBegin(id.to_string(), cred, r))
            .await?
    }
    /// `write: None` for reads (open to all, not counted); `Some(cred)` for
    /// a write, fenced by the lease and counted in flight.
    pub async fn files_begin(
        &self,
        id: &str,
        write: Option<Option<Credential>>,
    ) -> Result<FilesTicket, RunError> {
        self.ask(|r| Cmd::FilesBegin(id.to_string(), write, r))
            .await?
    }
    /// A lease operation; `Ok(Some(lease))` for grants and renewals.
    pub async fn lease(&self, id: &str, op: LeaseOp) -> Result<Option<Value>, RunError> {
        self.ask(|r| Cmd::Lease(id.to_string(), op, r)).await?
    }
    pub async fn op_end(&self, id: &str) {
        let _ = self.tx.send(Cmd::OpEnd(id.to_string())).await;
    }
    pub async fn tick(&self) {
        let _ = self.tx.send(Cmd::Tick).await;
    }
    pub async fn shutdown(&self, stop_runs: bool) {
        let _ = self.ask(|r| Cmd::Shutdown(stop_runs, r)).await;
    }
}
