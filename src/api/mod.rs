//! The REST API: routes, bearer auth, wire types and the one mapping from
//! domain errors to statuses.

mod error;
mod images;
mod leases;
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
    pub images: Arc<crate::imagesvc::Images>,
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
            get(routes::get_run)
                .delete(routes::delete_run)
                .patch(routes::patch_run),
        )
        .route("/v1/runs/{id}/exec", post(routes::exec))
        .route("/v1/runs/{id}/lease", post(leases::acquire))
        .route("/v1/runs/{id}/lease/renew", post(leases::renew))
        .route("/v1/runs/{id}/lease/release", post(leases::release))
        .route("/v1/runs/{id}/files", get(routes::get_work_root))
        .route(
            "/v1/runs/{id}/files/{*path}",
            get(routes::get_file).put(routes::put_file),
        )
        .route("/v1/templates", get(routes::templates))
        .route("/v1/images", get(images::list).delete(images::remove))
        .route("/v1/images/pull", post(images::pull))
        .route("/v1/images/import", post(images::import))
        .route("/v1/openapi.json", get(openapi::openapi))
        .route_layer(axum::middleware::from_fn_with_state(st.clone(), auth));
    Router::new()
        .route("/health", get(routes::health))
        .merge(protected)
        .fallback(routes::not_found)
        .layer(axum::extract::DefaultBodyLimit::max(
            st.max_file_bytes as usize + 1,
        ))
        .layer(axum::middleware::from_fn_with_state(
            st.clone(),
            server_header,
        ))
        .with_state(st)
}

async fn server_header(State(st): State<Shared>, req: Request, next: Next) -> Response {
    let mut resp = next.run(req).await;
    if let Ok(v) = header::HeaderValue::from_str(&st.server) {
        resp.headers_mut().insert(header::SERVER, v);
    }
    resp
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use axum::http::{Method, Request, StatusCode};
    use tower::ServiceExt;

    fn state() -> Shared {
        let (tx, _rx) = tokio::sync::mpsc::channel(1);
        let dir = tempfile::tempdir().expect("tmp").keep();
        let cfg = crate::config::Config::resolve(
            crate::config::FileConfig::default(),
            &crate::config::ServeFlags::default(),
            &Default::default(),
        )
        .expect("config");
        Arc::new(AppState {
            runs: Runs::detached(tx),
            images: Arc::new(crate::imagesvc::Images::new(&cfg, &dir).expect("images")),
            host: Arc::new(Host {
                state_dir: "/nonexistent".into(),
                layout: sbx_runtime::Layout::V2 {
                    root: "/nonexistent".into(),
                },
                self_exe: "/nonexistent".into(),
                init_binary: "/nonexistent".into(),
                seccomp: None,
                cgroup_parent: "/sbx-test".into(),
                zygote: Arc::new(crate::runs::sandbox::ShimZygote::new(
                    "/nonexistent".into(),
                    "/nonexistent".into(),
                )),
                spares: Arc::new(crate::runs::sandbox::SpareDirs::new("/nonexistent".into())),
            }),
            server: "unit".into(),
            token: "t0k".into(),
            max_file_bytes: 1024,
            templates: crate::config::default_templates(),
            shutting_down: std::sync::atomic::AtomicBool::new(false),
        })
    }

    async fn send(
        method: Method,
        uri: &str,
        token: Option<&str>,
        body: &str,
    ) -> (StatusCode, serde_json::Value) {
        let mut b = Request::builder().method(method).uri(uri);
        if let Some(t) = token {
            b = b.header("authorization", format!("Bearer {t}"));
        }
        let resp = router(state())
            .oneshot(b.body(Body::from(body.to_string())).expect("request"))
            .await
            .expect("response");
        let status = resp.status();
        let bytes = axum::body::to_bytes(resp.into_body(), 1 << 20)
            .await
            .expect("body");
        (
            status,
            serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null),
        )
    }

    #[tokio::test]
    async fn every_documented_route_exists_and_needs_the_token() {
        for (m, path) in openapi::ROUTES {
            let uri = path
                .replace("{id}", "01ARZ3NDEKTSV4RRFFQ69G5FAV")
                .replace("{path}", "x");
            let method = Method::from_bytes(m.to_uppercase().as_bytes()).expect("method");
            let (status, body) = send(method.clone(), &uri, None, "").await;
            if *path == "/health" {
                assert_eq!(status, StatusCode::OK);
                assert_eq!(body["server"], "unit");
            } else {
                assert_eq!(
                    status,
                    StatusCode::UNAUTHORIZED,
                    "{m} {path} must need auth"
                );
                assert_eq!(body["error"], "unauthorized");
            }
        }
        let (status, body) = send(Method::GET, "/v1/nope", Some("t0k"), "").await;
        assert_eq!(
            (status, body["message"].as_str()),
            (StatusCode::NOT_FOUND, Some("no such route"))
        );
    }

    #[tokio::test]
    async fn bad_bodies_are_400s_naming_the_field() {
        let (status, body) = send(Method::POST, "/v1/runs", Some("t0k"), r#"{"ttlSec": 0}"#).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert!(
            body["message"]
                .as_str()
                .expect("msg")
                .starts_with("ttlSec:"),
            "{body}"
        );
        let (status, body) = send(Method::POST, "/v1/runs", Some("t0k"), r#"{"extra": 1}"#).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert!(
            body["message"].as_str().expect("msg").contains("extra"),
            "{body}"
        );
        let (status, body) = send(Method::POST, "/v1/runs", Some("t0k"), "{not json").await;
        assert_eq!(
            (status, body["error"].as_str()),
            (StatusCode::BAD_REQUEST, Some("bad_request"))
        );
        let (status, _) = send(Method::POST, "/v1/runs", Some("wrong"), "{}").await;
        assert_eq!(status, StatusCode::UNAUTHORIZED);
        let (status, body) = send(Method::GET, "/v1/templates", Some("t0k"), "").await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(body["templates"][0]["name"], "base");
    }
}
