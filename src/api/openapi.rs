//! `GET /v1/openapi.json`: the API description, kept true by a test that
//! checks every route of the router is described and vice versa.

use axum::Json;
use serde_json::{json, Value};

/// (method, path) of every route, as the router registers them.
#[cfg(test)]
pub const ROUTES: &[(&str, &str)] = &[
    ("get", "/health"),
    ("post", "/v1/runs"),
    ("get", "/v1/runs"),
    ("get", "/v1/runs/{id}"),
    ("delete", "/v1/runs/{id}"),
    ("patch", "/v1/runs/{id}"),
    ("post", "/v1/runs/{id}/exec"),
    ("post", "/v1/runs/{id}/lease"),
    ("post", "/v1/runs/{id}/lease/renew"),
    ("post", "/v1/runs/{id}/lease/release"),
    ("get", "/v1/runs/{id}/files"),
    ("get", "/v1/runs/{id}/files/{path}"),
    ("put", "/v1/runs/{id}/files/{path}"),
    ("get", "/v1/templates"),
    ("get", "/v1/images"),
    ("delete", "/v1/images"),
    ("post", "/v1/images/pull"),
    ("post", "/v1/images/import"),
    ("get", "/v1/openapi.json"),
];

fn err() -> Value {
    json!({"description": "error", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}})
}

pub fn document() -> Value {
    let run = json!({"$ref": "#/components/schemas/Run"});
    let ok = |d: &str, schema: Value| json!({"description": d, "content": {"application/json": {"schema": schema}}});
    let id = json!({"name": "id", "in": "path", "required": true, "schema": {"type": "string"}});
    let lease = json!({"type": "object", "properties": {"server": {"type": "string"}, "lease": {"type": "object", "properties": {
        "holder": {"type": "string"}, "generation": {"type": "integer"}, "expiresAt": {"type": "string", "format": "date-time"}}}}});
    let conflict = json!({"description": "busy, held (holder, generation, expiresAt) or superseded (given, generation)",
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}});
    let path = json!({"name": "path", "in": "path", "required": true, "schema": {"type": "string"},
                      "description": "relative to /work"});
    json!({
        "openapi": "3.0.3",
        "info": {"title": "sbx", "version": env!("CARGO_PKG_VERSION")},
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {
                "Error": {"type": "object", "required": ["error", "message"],
                          "properties": {"error": {"type": "string"}, "message": {"type": "string"},
                                         "server": {"type": "string"}}},
                "Run": {"type": "object", "properties": {
                    "id": {"type": "string"}, "server": {"type": "string"},
                    "status": {"type": "string", "enum": ["creating", "running", "killed", "expired", "error"]},
                    "image": {"type": "string"}, "template": {"type": "string"},
                    "network": {"type": "string"}, "expiresAt": {"type": "string", "format": "date-time"},
                    "createdAt": {"type": "string", "format": "date-time"},
                    "endedAt": {"type": "string", "format": "date-time"},
                    "limits": {"type": "object"}, "labels": {"type": "object"},
                    "user": {"type": "string"}, "workdir": {"type": "string"},
                    "env": {"type": "array", "items": {"type": "string"}, "description": "names only"},
                    "lease": {"nullable": true, "type": "object"}, "error": {"type": "string"}}},
                "CreateRun": {"type": "object", "additionalProperties": false, "properties": {
                    "image": {"type": "string"}, "template": {"type": "string"},
                    "env": {"type": "object", "additionalProperties": {"type": "string"}},
                    "ttlSec": {"type": "integer", "minimum": 1, "maximum": 86400},
                    "network": {"type": "string", "enum": ["none", "allowlist", "egress", "open"]},
                    "egressAllow": {"type": "array", "items": {"type": "string"}},
                    "limits": {"type": "object", "additionalProperties": false, "properties": {
                        "cpu": {"type": "number", "minimum": 0.1, "maximum": 64},
                        "memoryMb": {"type": "integer", "minimum": 64, "maximum": 262144},
                        "pids": {"type": "integer", "minimum": 16, "maximum": 65536}}},
                    "warm": {"type": "object"},
                    "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                    "user": {"type": "string", "pattern": "^[0-9]+(:[0-9]+)?$"},
                    "workdir": {"type": "string"}}},
                "Exec": {"type": "object", "additionalProperties": false, "required": ["cmd"], "properties": {
                    "cmd": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
                    "cwd": {"type": "string"}, "timeoutSec": {"type": "integer", "minimum": 1, "maximum": 600},
                    "env": {"type": "object", "additionalProperties": {"type": "string"}},
                    "stdin": {"type": "string"}, "owner": {"type": "string"}, "generation": {"type": "integer"}}}
            }
        },
        "security": [{"bearer": []}],
        "paths": {
            "/health": {"get": {"security": [], "summary": "liveness; no auth",
                "responses": {"200": ok("status", json!({"type": "object"}))}}},
            "/v1/runs": {
                "post": {"summary": "create a run",
                    "requestBody": {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/CreateRun"}}}},
                    "responses": {"201": ok("created", run.clone()), "400": err(), "401": err(), "422": err(), "503": err()}},
                "get": {"summary": "list runs",
                    "parameters": [{"name": "status", "in": "query", "schema": {"type": "string"}},
                                   {"name": "label", "in": "query", "schema": {"type": "string"}, "description": "key or key=value"}],
                    "responses": {"200": ok("runs", json!({"type": "object"})), "400": err(), "401": err()}}},
            "/v1/runs/{id}": {
                "parameters": [id.clone()],
                "get": {"summary": "one run", "responses": {"200": ok("run", run.clone()), "404": err()}},
                "delete": {"summary": "destroy now; record kept as killed unless purge=true",
                    "parameters": [{"name": "purge", "in": "query", "schema": {"type": "boolean"}}],
                    "responses": {"200": ok("killed", run.clone()), "204": {"description": "purged"}, "404": err()}},
                "patch": {"summary": "set the TTL from now",
                    "requestBody": {"content": {"application/json": {"schema": {"type": "object", "required": ["ttlSec"],
                        "properties": {"ttlSec": {"type": "integer"}}}}}},
                    "responses": {"200": ok("run", run), "400": err(), "404": err(), "409": err()}}},
            "/v1/runs/{id}/exec": {"parameters": [id.clone()],
                "post": {"summary": "run a command; SSE stdout/stderr/exit events, or one JSON object with Accept: application/json",
                    "requestBody": {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Exec"}}}},
                    "responses": {"200": {"description": "events", "content": {"text/event-stream": {}, "application/json": {}}},
                                  "400": err(), "404": err(), "409": err()}}},
            "/v1/runs/{id}/lease": {"parameters": [id.clone()],
                "post": {"summary": "take the writable lease; every grant bumps the generation (the fencing token)",
                    "requestBody": {"content": {"application/json": {"schema": {"type": "object", "required": ["owner", "ttlSec"],
                        "properties": {"owner": {"type": "string"}, "ttlSec": {"type": "integer"}}}}}},
                    "responses": {"200": ok("granted", lease.clone()), "400": err(), "404": err(), "409": conflict.clone()}}},
            "/v1/runs/{id}/lease/renew": {"parameters": [id.clone()],
                "post": {"summary": "extend the lease from now; needs the exact owner and generation",
                    "requestBody": {"content": {"application/json": {"schema": {"type": "object", "required": ["owner", "generation", "ttlSec"],
                        "properties": {"owner": {"type": "string"}, "generation": {"type": "integer"}, "ttlSec": {"type": "integer"}}}}}},
                    "responses": {"200": ok("renewed", lease), "400": err(), "404": err(), "409": conflict.clone()}}},
            "/v1/runs/{id}/lease/release": {"parameters": [id.clone()],
                "post": {"summary": "give the lease up",
                    "requestBody": {"content": {"application/json": {"schema": {"type": "object", "required": ["owner", "generation"],
                        "properties": {"owner": {"type": "string"}, "generation": {"type": "integer"}}}}}},
                    "responses": {"204": {"description": "released"}, "400": err(), "404": err(), "409": conflict}}},
            "/v1/runs/{id}/files": {"parameters": [id.clone()],
                "get": {"summary": "list /work", "responses": {"200": ok("listing", json!({"type": "object"})), "404": err()}}},
            "/v1/runs/{id}/files/{path}": {"parameters": [id, path],
                "get": {"summary": "read a file (bytes) or list a directory (JSON)",
                    "responses": {"200": {"description": "content"}, "400": err(), "404": err(), "413": err()}},
                "put": {"summary": "write a file; parents created; owned by the run's user",
                    "parameters": [{"name": "mode", "in": "query", "schema": {"type": "string"}},
                                   {"name": "owner", "in": "query", "schema": {"type": "string"}},
                                   {"name": "generation", "in": "query", "schema": {"type": "integer"}}],
                    "requestBody": {"content": {"application/octet-stream": {}}},
                    "responses": {"201": ok("written", json!({"type": "object"})), "400": err(), "404": err(), "413": err()}}},
            "/v1/templates": {"get": {"summary": "configured templates",
                "responses": {"200": ok("templates", json!({"type": "object"}))}}},
            "/v1/images": {
                "get": {"summary": "stored images (and the built-in host image)",
                    "responses": {"200": ok("images", json!({"type": "object"}))}},
                "delete": {"summary": "remove an image; unreferenced layers are collected",
                    "parameters": [{"name": "ref", "in": "query", "required": true, "schema": {"type": "string"}}],
                    "responses": {"200": ok("removed", json!({"type": "object"})), "400": err(), "404": err()}}},
            "/v1/images/pull": {"post": {"summary": "pull HOST[:PORT]/NAME[:TAG|@sha256:…]; SSE progress with Accept: text/event-stream",
                "requestBody": {"content": {"application/json": {"schema": {"type": "object", "required": ["reference"],
                    "properties": {"reference": {"type": "string"}}}}}},
                "responses": {"201": ok("pulled", json!({"type": "object"})), "400": err(), "422": err()}}},
            "/v1/images/import": {"post": {"summary": "import an OCI layout directory or a docker save archive from the daemon's host",
                "requestBody": {"content": {"application/json": {"schema": {"type": "object", "required": ["path"],
                    "properties": {"path": {"type": "string"}, "reference": {"type": "string"}}}}}},
                "responses": {"201": ok("imported", json!({"type": "object"})), "400": err(), "422": err()}}},
            "/v1/openapi.json": {"get": {"summary": "this document", "responses": {"200": {"description": "OpenAPI 3"}}}}
        }
    })
}

pub async fn openapi() -> Json<Value> {
    Json(document())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_route_is_described_and_nothing_else() {
        let doc = document();
        let mut described = Vec::new();
        for (path, ops) in doc["paths"].as_object().expect("paths") {
            for m in ["get", "post", "put", "patch", "delete"] {
                if ops.get(m).is_some() {
                    described.push((m.to_string(), path.clone()));
                }
            }
        }
        let mut routes: Vec<(String, String)> = ROUTES
            .iter()
            .map(|(m, p)| (m.to_string(), p.to_string()))
            .collect();
        routes.sort();
        described.sort();
        assert_eq!(described, routes);
    }
}
