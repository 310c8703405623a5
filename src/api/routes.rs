//! Route handlers: parse into domain types, ask the registry, shape replies.

use std::collections::HashMap;
use std::convert::Infallible;

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use base64::Engine;
use serde::de::DeserializeOwned;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::{ApiError, Shared};
use crate::runs::exec::{ExecEvent, ExitInfo};
use crate::runs::files::{self, Content};
use crate::runs::model::{CreateRequest, ExecBody, Status};
use crate::runs::ListFilter;

/// Cap per stream in the buffered JSON form of exec.
pub const JSON_STREAM_CAP: usize = 1 << 20;

/// Parses a JSON body; unknown fields and bad types are 400s naming them.
pub(super) fn parse<T: DeserializeOwned>(body: &Bytes) -> Result<T, ApiError> {
    if body.is_empty() {
        return serde_json::from_slice(b"{}").map_err(|e| ApiError::bad("body", e.to_string()));
    }
    serde_json::from_slice(body).map_err(|e| {
        let msg = e.to_string();
        let field = msg
            .split('`')
            .nth(1)
            .filter(|_| msg.starts_with("unknown field") || msg.starts_with("missing field"))
            .unwrap_or("body")
            .to_string();
        ApiError::bad(&field, msg)
    })
}

pub(super) fn check_id(id: &str) -> Result<(), ApiError> {
    if ulid::Ulid::from_string(id).is_err() {
        return Err(ApiError::NotFound(format!("run {id} not found")));
    }
    Ok(())
}

pub async fn health(State(st): State<Shared>) -> Json<Value> {
    let status = if st.shutting_down.load(std::sync::atomic::Ordering::Relaxed) {
        "shutting_down"
    } else {
        "ok"
    };
    Json(json!({"status": status, "version": env!("CARGO_PKG_VERSION"), "server": st.server}))
}

pub async fn not_found(State(st): State<Shared>) -> ApiError {
    let _ = st;
    ApiError::NotFound("no such route".into())
}

pub async fn templates(State(st): State<Shared>) -> Json<Value> {
    let list: Vec<Value> = st
        .templates
        .iter()
        .map(|(name, t)| json!({"name": name, "image": t.image, "user": t.user, "workdir": t.workdir}))
        .collect();
    Json(json!({"server": st.server, "templates": list}))
}

pub async fn create_run(State(st): State<Shared>, body: Bytes) -> Result<Response, ApiError> {
    let req: CreateRequest = parse(&body)?;
    if req.warm.is_some() {
        return Err(ApiError::Unprocessable(
            "warm: the warm repo cache is not available in this daemon yet".into(),
        ));
    }
    let plan = req.plan(&st.templates)?;
    let v = st.runs.create(plan).await?;
    Ok((StatusCode::CREATED, Json(v)).into_response())
}

pub async fn list_runs(
    State(st): State<Shared>,
    Query(q): Query<HashMap<String, String>>,
) -> Result<Json<Value>, ApiError> {
    let mut filter = ListFilter::default();
    for (k, v) in &q {
        match k.as_str() {
            "status" => {
                filter.status = Some(Status::parse(v).ok_or_else(|| {
                    ApiError::bad(
                        "status",
                        "must be creating, running, killed, expired or error",
                    )
                })?)
            }
            "label" => {
                filter.label = Some(match v.split_once('=') {
                    Some((k, v)) => (k.to_string(), Some(v.to_string())),
                    None => (v.clone(), None),
                })
            }
            other => return Err(ApiError::bad(other, "unknown query parameter")),
        }
    }
    let runs = st.runs.list(filter).await?;
    Ok(Json(json!({"server": st.server, "runs": runs})))
}

pub async fn get_run(
    State(st): State<Shared>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    check_id(&id)?;
    Ok(Json(st.runs.get(&id).await?))
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct PatchBody {
    ttl_sec: u64,
}

pub async fn patch_run(
    State(st): State<Shared>,
    Path(id): Path<String>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    check_id(&id)?;
    let b: PatchBody = parse(&body)?;
    if b.ttl_sec == 0 || b.ttl_sec > crate::runs::model::MAX_TTL_SECS {
        return Err(ApiError::bad(
            "ttlSec",
            format!("must be 1 to {}", crate::runs::model::MAX_TTL_SECS),
        ));
    }
    Ok(Json(st.runs.patch_ttl(&id, b.ttl_sec).await?))
}

pub async fn delete_run(
    State(st): State<Shared>,
    Path(id): Path<String>,
    Query(q): Query<HashMap<String, String>>,
) -> Result<Response, ApiError> {
    check_id(&id)?;
    let purge = match q.get("purge").map(String::as_str) {
        None | Some("false") | Some("0") => false,
        Some("true") | Some("1") => true,
        Some(_) => return Err(ApiError::bad("purge", "must be true or false")),
    };
    st.runs.delete(&id, purge).await?;
    if purge {
        return Ok(StatusCode::NO_CONTENT.into_response());
    }
    Ok(Json(st.runs.get(&id).await?).into_response())
}

/// Text when it is UTF-8, base64 otherwise.
fn encode_chunk(b: &[u8]) -> Value {
    match std::str::from_utf8(b) {
        Ok(s) => json!({"data": s}),
        Err(_) => {
            json!({"data": base64::engine::general_purpose::STANDARD.encode(b), "encoding": "base64"})
        }
    }
}

/// Splits off a trailing incomplete UTF-8 sequence so a chunk boundary never
/// turns text into base64.
fn split_utf8(pending: &mut Vec<u8>) -> Vec<u8> {
    let cut = match std::str::from_utf8(pending) {
        Ok(_) => pending.len(),
        Err(e) if e.error_len().is_none() => e.valid_up_to(),
        Err(_) => pending.len(),
    };
    let rest = pending.split_off(cut);
    std::mem::replace(pending, rest)
}

/// Ends an in-flight operation: explicitly before the client hears the
/// result (so a lease acquire right after is not `busy`), or on drop when
/// the request is abandoned.
struct OpGuard {
    runs: crate::runs::Runs,
    id: String,
    armed: bool,
}

impl OpGuard {
    fn new(runs: &crate::runs::Runs, id: &str) -> OpGuard {
        OpGuard {
            runs: runs.clone(),
            id: id.to_string(),
            armed: true,
        }
    }

    async fn finish(mut self) {
        self.armed = false;
        self.runs.op_end(&self.id).await;
    }
}

impl Drop for OpGuard {
    fn drop(&mut self) {
        if self.armed {
            let (runs, id) = (self.runs.clone(), std::mem::take(&mut self.id));
            tokio::spawn(async move { runs.op_end(&id).await });
        }
    }
}

pub async fn exec(
    State(st): State<Shared>,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    check_id(&id)?;
    let b: ExecBody = parse(&body)?;
    let plan = b.plan()?;
    let ticket = st.runs.exec_begin(&id, plan.credential.clone()).await?;
    let guard = OpGuard::new(&st.runs, &id);
    let (tx, mut rx) = mpsc::channel::<ExecEvent>(64);
    let host = st.host.clone();
    tokio::spawn(async move {
        let info = match crate::runs::exec::run(&host, &ticket, plan, tx.clone()).await {
            Ok(info) => info,
            Err(e) => {
                tracing::error!(run = %ticket.id, error = %e, "exec");
                let msg = format!("sbx: exec failed: {e}\n");
                let _ = tx.send(ExecEvent::Stderr(Bytes::from(msg))).await;
                ExitInfo {
                    exit_code: 125,
                    timed_out: false,
                    duration_ms: 0,
                }
            }
        };
        guard.finish().await;
        let _ = tx.send(ExecEvent::Exit(info)).await;
    });
    let wants_json = headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("application/json") && !v.contains("text/event-stream"));
    if wants_json {
        let (mut out, mut err, mut truncated) = (Vec::new(), Vec::new(), false);
        let mut exit = None;
        while let Some(ev) = rx.recv().await {
            match ev {
                ExecEvent::Stdout(b) => truncated |= append_capped(&mut out, &b),
                ExecEvent::Stderr(b) => truncated |= append_capped(&mut err, &b),
                ExecEvent::Exit(x) => {
                    exit = Some(x);
                    break;
                }
            }
        }
        let x = exit.ok_or_else(|| ApiError::Internal("exec ended without an exit".into()))?;
        let mut v = json!({
            "server": st.server, "exitCode": x.exit_code, "timedOut": x.timed_out,
            "truncated": truncated, "durationMs": x.duration_ms,
        });
        for (name, bytes) in [("stdout", &out), ("stderr", &err)] {
            let c = encode_chunk(bytes);
            v[name] = c["data"].clone();
            if c.get("encoding").is_some() {
                v[format!("{name}Encoding")] = json!("base64");
            }
        }
        return Ok(Json(v).into_response());
    }
    let stream = async_stream(rx);
    Ok(Sse::new(stream).into_response())
}

fn append_capped(buf: &mut Vec<u8>, b: &[u8]) -> bool {
    let room = JSON_STREAM_CAP.saturating_sub(buf.len());
    buf.extend_from_slice(&b[..b.len().min(room)]);
    b.len() > room
}

fn async_stream(
    mut rx: mpsc::Receiver<ExecEvent>,
) -> impl futures_util::Stream<Item = Result<Event, Infallible>> {
    let (mut pend_out, mut pend_err) = (Vec::new(), Vec::new());
    let (etx, erx) = mpsc::channel::<Result<Event, Infallible>>(64);
    tokio::spawn(async move {
        while let Some(ev) = rx.recv().await {
            let event = match ev {
                ExecEvent::Stdout(b) => {
                    pend_out.extend_from_slice(&b);
                    let ready = split_utf8(&mut pend_out);
                    if ready.is_empty() {
                        continue;
                    }
                    Event::default()
                        .event("stdout")
                        .data(encode_chunk(&ready).to_string())
                }
                ExecEvent::Stderr(b) => {
                    pend_err.extend_from_slice(&b);
                    let ready = split_utf8(&mut pend_err);
                    if ready.is_empty() {
                        continue;
                    }
                    Event::default()
                        .event("stderr")
                        .data(encode_chunk(&ready).to_string())
                }
                ExecEvent::Exit(x) => {
                    for (name, p) in [("stdout", &pend_out), ("stderr", &pend_err)] {
                        if !p.is_empty() {
                            let _ = etx
                                .send(Ok(Event::default()
                                    .event(name)
                                    .data(encode_chunk(p).to_string())))
                                .await;
                        }
                    }
                    let mut v = serde_json::to_value(x).unwrap_or_default();
                    v["truncated"] = json!(false);
                    let _ = etx
                        .send(Ok(Event::default().event("exit").data(v.to_string())))
                        .await;
                    break;
                }
            };
            if etx.send(Ok(event)).await.is_err() {
                // Client went away; keep consuming so the exec can finish.
                continue;
            }
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(erx)
}

/// `write`: `None` for a read; `Some(credential)` for a fenced write.
async fn files_op<T: Send + 'static>(
    st: &Shared,
    id: &str,
    write: Option<Option<crate::runs::Credential>>,
    f: impl FnOnce(crate::runs::FilesTicket) -> Result<T, files::FileError> + Send + 'static,
) -> Result<T, ApiError> {
    check_id(id)?;
    let is_write = write.is_some();
    let ticket = st.runs.files_begin(id, write).await?;
    let guard = is_write.then(|| OpGuard::new(&st.runs, id));
    let result = tokio::task::spawn_blocking(move || f(ticket)).await;
    if let Some(g) = guard {
        g.finish().await;
    }
    result
        .map_err(|e| ApiError::Internal(e.to_string()))?
        .map_err(ApiError::from)
}

fn content_response(st: &Shared, c: Content) -> Response {
    match c {
        Content::File(bytes) => {
            ([(header::CONTENT_TYPE, "application/octet-stream")], bytes).into_response()
        }
        Content::Dir(entries) => {
            Json(json!({"server": st.server, "entries": entries})).into_response()
        }
    }
}

pub async fn get_work_root(
    State(st): State<Shared>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let max = st.max_file_bytes;
    let c = files_op(&st, &id, None, move |t| files::read(&t.rootfs, "", max)).await?;
    Ok(content_response(&st, c))
}

pub async fn get_file(
    State(st): State<Shared>,
    Path((id, path)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    let max = st.max_file_bytes;
    let c = files_op(&st, &id, None, move |t| files::read(&t.rootfs, &path, max)).await?;
    Ok(content_response(&st, c))
}

pub async fn put_file(
    State(st): State<Shared>,
    Path((id, path)): Path<(String, String)>,
    Query(q): Query<HashMap<String, String>>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let mut mode = 0o644;
    for (k, v) in &q {
        match k.as_str() {
            "mode" => {
                mode = u32::from_str_radix(v, 8)
                    .ok()
                    .filter(|m| *m <= 0o7777)
                    .ok_or_else(|| ApiError::bad("mode", "must be octal, at most 7777"))?
            }
            "owner" | "generation" => {}
            other => return Err(ApiError::bad(other, "unknown query parameter")),
        }
    }
    let generation = match q.get("generation") {
        Some(g) => Some(
            g.parse::<u64>()
                .map_err(|_| ApiError::bad("generation", "must be a number"))?,
        ),
        None => None,
    };
    let credential = crate::runs::model::credential(q.get("owner").cloned(), generation)?;
    if body.len() as u64 > st.max_file_bytes {
        return Err(ApiError::TooLarge(format!(
            "larger than the limit of {} bytes",
            st.max_file_bytes
        )));
    }
    let size = body.len();
    let p = path.clone();
    files_op(&st, &id, Some(credential), move |t| {
        files::write(&t.rootfs, &p, &body, mode, t.uid, t.gid)
    })
    .await?;
    Ok((
        StatusCode::CREATED,
        Json(json!({"server": st.server, "path": format!("/work/{path}"), "size": size})),
    )
        .into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utf8_split_holds_back_an_incomplete_sequence() {
        let mut p = "hé".as_bytes().to_vec();
        p.pop();
        let ready = split_utf8(&mut p);
        assert_eq!(ready, b"h");
        assert_eq!(p, vec![0xc3]);
        p.push(0xa9);
        assert_eq!(split_utf8(&mut p), "é".as_bytes());
        assert!(p.is_empty());
    }

    #[test]
    fn binary_is_base64() {
        assert_eq!(
            encode_chunk(&[0xff, 0x00]),
            json!({"data": "/wA=", "encoding": "base64"})
        );
        assert_eq!(encode_chunk(b"hi"), json!({"data": "hi"}));
    }

    #[test]
    fn capped_append_reports_truncation() {
        let mut b = vec![0u8; JSON_STREAM_CAP - 1];
        assert!(append_capped(&mut b, b"xy"));
        assert_eq!(b.len(), JSON_STREAM_CAP);
    }
}
