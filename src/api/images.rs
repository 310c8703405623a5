//! Image routes: list, pull (with SSE progress), import, remove.

use std::collections::HashMap;
use std::convert::Infallible;

use axum::body::Bytes;
use axum::extract::{Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::routes::parse;
use super::{ApiError, Shared};
use sbx_images::store::{ImageError, ImageRecord};

impl From<ImageError> for ApiError {
    fn from(e: ImageError) -> Self {
        let msg = format!("{:#}", anyhow::Error::from(e));
        match msg.split_once(" is not a valid image reference") {
            Some(_) => ApiError::bad("reference", msg),
            None if msg.contains("is not in the store") => ApiError::NotFound(msg),
            None => ApiError::Unprocessable(msg),
        }
    }
}

fn view(r: &ImageRecord) -> Value {
    json!({
        "reference": r.reference, "digest": r.digest, "layers": r.layers,
        "sizeBytes": r.size_bytes, "env": r.config.env,
        "storedAt": crate::runs::rfc3339(r.stored_at_ms),
    })
}

pub async fn list(State(st): State<Shared>) -> Json<Value> {
    let mut images: Vec<Value> =
        vec![json!({"reference": crate::runs::model::HOST_IMAGE, "builtin": true})];
    images.extend(st.images.list().iter().map(view));
    Json(json!({"server": st.server, "images": images}))
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct PullBody {
    reference: String,
}

pub async fn pull(
    State(st): State<Shared>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let b: PullBody = parse(&body)?;
    sbx_images::store::parse_reference(&b.reference)?;
    let sse = headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("text/event-stream"));
    if !sse {
        let rec = st.images.pull(&b.reference, None).await?;
        return Ok((StatusCode::CREATED, Json(view(&rec))).into_response());
    }
    let (tx, rx) = mpsc::unbounded_channel::<Result<Event, Infallible>>();
    let progress_tx = tx.clone();
    let progress: sbx_images::store::ProgressFn = std::sync::Arc::new(move |p| {
        let data = serde_json::to_string(&p).unwrap_or_default();
        let _ = progress_tx.send(Ok(Event::default().event("progress").data(data)));
    });
    let images = st.images.clone();
    tokio::spawn(async move {
        let ev = match images.pull(&b.reference, Some(progress)).await {
            Ok(rec) => Event::default().event("done").data(view(&rec).to_string()),
            Err(e) => Event::default()
                .event("error")
                .data(json!({"message": format!("{:#}", anyhow::Error::from(e))}).to_string()),
        };
        let _ = tx.send(Ok(ev));
    });
    Ok(Sse::new(tokio_stream::wrappers::UnboundedReceiverStream::new(rx)).into_response())
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct ImportBody {
    path: String,
    reference: Option<String>,
}

pub async fn import(State(st): State<Shared>, body: Bytes) -> Result<Response, ApiError> {
    let b: ImportBody = parse(&body)?;
    if !b.path.starts_with('/') {
        return Err(ApiError::bad(
            "path",
            "must be an absolute path on the daemon's host",
        ));
    }
    if let Some(r) = &b.reference {
        sbx_images::store::parse_reference(r)?;
    }
    let recs = st.images.import(b.path.into(), b.reference).await?;
    Ok((
        StatusCode::CREATED,
        Json(json!({"server": st.server, "images": recs.iter().map(view).collect::<Vec<_>>()})),
    )
        .into_response())
}

pub async fn remove(
    State(st): State<Shared>,
    Query(q): Query<HashMap<String, String>>,
) -> Result<Json<Value>, ApiError> {
    let reference = q
        .get("ref")
        .ok_or_else(|| ApiError::bad("ref", "required"))?;
    if reference == crate::runs::model::HOST_IMAGE {
        return Err(ApiError::bad(
            "ref",
            "the built-in host image cannot be removed",
        ));
    }
    let removed = st.images.remove(reference).await?;
    Ok(Json(
        json!({"server": st.server, "removed": reference, "removedLayers": removed}),
    ))
}
