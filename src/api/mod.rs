//! The REST API: routes, bearer auth, wire types and the one mapping from
//! domain errors to statuses.

mod error;
mod openapi;
mod routes;

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::Response;
use axum::routing::{get, post};
use axum::Router;
use subtle::ConstantTimeEq;

pub use error::ApiError;

use crate::runs::sandbox::Host;
use crate::runs::Runs;

pub struct AppState {
    pub runs: Runs,
    pub host: Arc<Host>,
    pub server: String,
    pub token: String,
    pub max_file_bytes: u64,
    pub templates: std::collections::BTreeMap<String, crate::config::Template>,
    pub shutting_down: std::sync::atomic::AtomicBool,
}

pub type Shared = Arc<AppState>;

async fn auth(State(st): State<Shared>, req: Request, next: Next) -> Result<Response, ApiError> {
    let given = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    if !bool::from(given.as_bytes().ct_eq(st.token.as_bytes())) || st.token.is_empty() {
        return Err(ApiError::Unauthorized);
    }
    if st.shutting_down.load(std::sync::atomic::Ordering::Relaxed) {
        return Err(ApiError::ShuttingDown);
    }
    Ok(next.run(req).await)
}

pub fn router(st: Shared) -> Router {
    let protected = Router::new()
        .route("/v1/runs", post(routes::create_run).get(routes::list_runs))
        .route(
            "/v1/runs/{id}",
            get(routes::get_run).delete(routes::delete_run).patch(routes::patch_run),
        )
        .route("/v1/runs/{id}/exec", post(routes::exec))
        .route("/v1/runs/{id}/files", get(routes::get_work_root))
        .route("/v1/runs/{id}/files/{*path}", get(routes::get_file).put(routes::put_file))
        .route("/v1/templates", get(routes::templates))
        .route("/v1/openapi.json", get(openapi::openapi))
        .route_layer(axum::middleware::from_fn_with_state(st.clone(), auth));
    Router::new()
        .route("/health", get(routes::health))
        .merge(protected)
        .fallback(routes::not_found)
        .layer(axum::extract::DefaultBodyLimit::max(st.max_file_bytes as usize + 1))
        .layer(axum::middleware::from_fn_with_state(st.clone(), server_header))
        .with_state(st)
}

async fn server_header(State(st): State<Shared>, req: Request, next: Next) -> Response {
    let mut resp = next.run(req).await;
    if let Ok(v) = header::HeaderValue::from_str(&st.server) {
        resp.headers_mut().insert(header::SERVER, v);
    }
    resp
}
