//! Lease routes: acquire, renew, release.

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use super::routes::{check_id, parse};
use super::{ApiError, Shared};
use crate::leases::MAX_LEASE_TTL_SECS;
use crate::runs::model::validate_owner;
use crate::runs::LeaseOp;

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct LeaseBody {
    owner: String,
    generation: Option<u64>,
    ttl_sec: Option<u64>,
}

fn ttl(b: &LeaseBody) -> Result<u64, ApiError> {
    let t = b
        .ttl_sec
        .ok_or_else(|| ApiError::bad("ttlSec", "required"))?;
    if t == 0 || t > MAX_LEASE_TTL_SECS {
        return Err(ApiError::bad(
            "ttlSec",
            format!("must be 1 to {MAX_LEASE_TTL_SECS}"),
        ));
    }
    Ok(t)
}

fn generation(b: &LeaseBody) -> Result<u64, ApiError> {
    b.generation
        .ok_or_else(|| ApiError::bad("generation", "required"))
}

#[derive(Clone, Copy)]
enum Kind {
    Acquire,
    Renew,
    Release,
}

async fn lease(st: Shared, id: String, body: Bytes, kind: Kind) -> Result<Response, ApiError> {
    check_id(&id)?;
    let b: LeaseBody = parse(&body)?;
    let owner = validate_owner("owner", &b.owner)?;
    let op = match kind {
        Kind::Acquire => {
            if b.generation.is_some() {
                return Err(ApiError::bad("generation", "not taken by acquire"));
            }
            LeaseOp::Acquire {
                owner,
                ttl_secs: ttl(&b)?,
            }
        }
        Kind::Renew => LeaseOp::Renew {
            owner,
            generation: generation(&b)?,
            ttl_secs: ttl(&b)?,
        },
        Kind::Release => {
            if b.ttl_sec.is_some() {
                return Err(ApiError::bad("ttlSec", "not taken by release"));
            }
            LeaseOp::Release {
                owner,
                generation: generation(&b)?,
            }
        }
    };
    match st.runs.lease(&id, op).await? {
        Some(lease) => Ok(Json(json!({"server": st.server, "lease": lease})).into_response()),
        None => Ok(StatusCode::NO_CONTENT.into_response()),
    }
}

pub async fn acquire(
    State(st): State<Shared>,
    Path(id): Path<String>,
    body: Bytes,
) -> Result<Response, ApiError> {
    lease(st, id, body, Kind::Acquire).await
}

pub async fn renew(
    State(st): State<Shared>,
    Path(id): Path<String>,
    body: Bytes,
) -> Result<Response, ApiError> {
    lease(st, id, body, Kind::Renew).await
}

pub async fn release(
    State(st): State<Shared>,
    Path(id): Path<String>,
    body: Bytes,
) -> Result<Response, ApiError> {
    lease(st, id, body, Kind::Release).await
}
