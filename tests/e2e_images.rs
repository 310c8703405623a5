//! End-to-end: images from the local registry and from OCI layouts, with a
//! real daemon. Needs root and the registry (scripts/registry,
//! scripts/build-images).

mod common;

use common::{registry, require_registry, wait_for, Daemon};
use reqwest::Method;
use serde_json::json;
use std::os::unix::fs::{MetadataExt, PermissionsExt};

fn busybox() -> String {
    format!("{}/sbx/busybox:1", registry())
}
fn python() -> String {
    format!("{}/sbx/python:1", registry())
}

fn insecure() -> Vec<String> {
    vec!["--insecure-registry".into(), registry()]
}

fn start() -> Daemon {
    let args = insecure();
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    Daemon::start(&refs)
}

#[test]
fn pulls_layers_once_and_runs_registry_images() {
    if !require_registry("pulls_layers_once_and_runs_registry_images") {
        return;
    }
    let d = start();
    // Two concurrent pulls of one image: no race, one copy of each layer.
    let (a, b) = std::thread::scope(|s| {
        let a = s.spawn(|| {
            d.call(
                Method::POST,
                "/v1/images/pull",
                Some(json!({"reference": busybox()})),
            )
        });
        let b = s.spawn(|| {
            d.call(
                Method::POST,
                "/v1/images/pull",
                Some(json!({"reference": busybox()})),
            )
        });
        (a.join().expect("a"), b.join().expect("b"))
    });
    assert_eq!((a.0, b.0), (201, 201), "{a:?} {b:?}");
    assert_eq!(a.1["layers"].as_array().expect("layers").len(), 3);
    let layers_dir = d.state.join("images/layers");
    assert_eq!(std::fs::read_dir(&layers_dir).expect("layers").count(), 3);
    assert_eq!(
        std::fs::read_dir(d.state.join("images/tmp"))
            .expect("tmp")
            .count(),
        0
    );

    // Three layers (gzip, zstd, plain); the third whites out a file of the second.
    let id = d.create(json!({"image": busybox()}));
    let v = d.sh(
        &id,
        "cat /etc/layer2; ls /etc/deleted-later 2>&1; echo $IMAGE_NAME; id -u",
    );
    assert_eq!(
        v["stdout"]
            .as_str()
            .map(|s| s.lines().collect::<Vec<_>>())
            .expect("lines")[0],
        "from layer two"
    );
    let out = v["stdout"].as_str().expect("stdout");
    assert!(out.contains("No such file"), "{out}");
    assert!(out.ends_with("busybox\n1000\n"), "{out}");
    // Writes go to the run's upper dir, never into the shared layers.
    d.sh(&id, "echo changed > /work/x; rm -f /bin/sh 2>&1; true");
    let id2 = d.create(json!({"image": busybox()}));
    assert_eq!(d.sh(&id2, "ls /work | wc -l")["stdout"], "0\n");
    d.call(Method::DELETE, &format!("/v1/runs/{id}"), None);
    assert_eq!(d.leftovers(&id), Vec::<String>::new());

    // A registry image with python3 and git, pulled on create.
    let (s, v) = d.call(Method::POST, "/v1/runs", Some(json!({"image": python()})));
    assert_eq!(s, 201, "{v}");
    let pid = v["id"].as_str().expect("id").to_string();
    let v = d.sh(&pid, "python3 -c 'print(6*7)'; git --version | cut -d' ' -f1-2; apt-get --version | head -1 | cut -d' ' -f1");
    assert_eq!(v["stdout"], "42\ngit version\napt\n");

    // Image removal collects only layers nothing uses.
    let (s, v) = d.call(Method::GET, "/v1/images", None);
    assert_eq!(s, 200);
    assert_eq!(
        v["images"].as_array().expect("images").len(),
        3,
        "host + 2: {v}"
    );
    let (s, v) = d
        .req(Method::DELETE, "/v1/images")
        .query(&[("ref", busybox())])
        .send()
        .map(|r| {
            (
                r.status().as_u16(),
                r.json::<serde_json::Value>().expect("json"),
            )
        })
        .expect("rm");
    assert_eq!(s, 200, "{v}");
    assert_eq!(
        v["removedLayers"].as_array().expect("removed").len(),
        0,
        "run {id2} still uses them"
    );
    d.call(Method::DELETE, &format!("/v1/runs/{id2}"), None);
    let (s, _) = d.call(
        Method::POST,
        "/v1/images/pull",
        Some(json!({"reference": python()})),
    );
    assert_eq!(s, 201);
    // Deleting the run frees them for the next collection (run at start-up too).
    let r = d
        .req(Method::DELETE, "/v1/images")
        .query(&[("ref", busybox())])
        .send()
        .expect("rm");
    assert_eq!(r.status().as_u16(), 404, "already removed");
}

#[test]
fn bad_and_missing_images_are_4xx_and_leave_nothing() {
    if !require_registry("bad_and_missing_images_are_4xx_and_leave_nothing") {
        return;
    }
    let d = start();
    let (s, v) = d.call(
        Method::POST,
        "/v1/images/pull",
        Some(json!({"reference": "Not A Ref"})),
    );
    assert_eq!(
        (
            s,
            v["message"].as_str().map(|m| m.starts_with("reference:"))
        ),
        (400, Some(true)),
        "{v}"
    );
    let missing = format!("{}/sbx/missing:1", registry());
    let (s, v) = d.call(Method::POST, "/v1/runs", Some(json!({"image": missing})));
    assert_eq!(s, 422, "{v}");
    // A registry that is not insecure-listed is spoken to over TLS, which fails.
    let strict = Daemon::start(&[]);
    let (s, v) = strict.call(
        Method::POST,
        "/v1/images/pull",
        Some(json!({"reference": busybox()})),
    );
    assert_eq!(s, 422, "{v}");
    for dm in [&d, &strict] {
        assert_eq!(
            std::fs::read_dir(dm.state.join("images/layers"))
                .expect("layers")
                .count(),
            0
        );
        assert_eq!(
            std::fs::read_dir(dm.state.join("images/tmp"))
                .expect("tmp")
                .count(),
            0
        );
        let (_, v) = dm.call(Method::GET, "/v1/runs", None);
        for r in v["runs"].as_array().expect("runs") {
            assert_eq!(r["status"], "error");
            assert_eq!(
                dm.leftovers(r["id"].as_str().expect("id")),
                Vec::<String>::new()
            );
        }
    }
}

#[test]
fn imports_an_oci_layout_and_a_docker_archive_without_a_registry() {
    if !require_registry("imports_an_oci_layout_and_a_docker_archive_without_a_registry") {
        return;
    }
    let cache = std::env::var("SBX_CACHE").unwrap_or_else(|_| "/var/cache/sbx-ci".into());
    let layout = std::path::Path::new(&cache).join("busybox-oci");
    assert!(
        layout.join("index.json").exists(),
        "scripts/build-images leaves {}",
        layout.display()
    );
    let d = Daemon::start(&[]);
    let (s, v) = d.call(
        Method::POST,
        "/v1/images/import",
        Some(json!({"path": layout, "reference": "local/busybox:oci"})),
    );
    assert_eq!(s, 201, "{v}");
    let id = d.create(json!({"image": "local/busybox:oci"}));
    assert_eq!(d.sh(&id, "cat /etc/layer2")["stdout"], "from layer two\n");
    // A docker-save archive (scripts/build-images makes it with skopeo).
    let tar = std::path::Path::new(&cache).join("busybox-docker.tar");
    assert!(
        tar.exists(),
        "scripts/build-images leaves {}",
        tar.display()
    );
    let (s, v) = d.call(
        Method::POST,
        "/v1/images/import",
        Some(json!({"path": tar})),
    );
    assert_eq!(s, 201, "{v}");
    assert_eq!(
        v["images"][0]["reference"], "docker.io/local/busybox:docker",
        "as skopeo tagged it"
    );
    let id = d.create(json!({"image": "local/busybox:docker"}));
    assert_eq!(d.sh(&id, "cat /etc/layer2")["stdout"], "from layer two\n");
    let (s, v) = d.call(
        Method::POST,
        "/v1/images/import",
        Some(json!({"path": "relative/x"})),
    );
    assert_eq!(
        (s, v["message"].as_str().map(|m| m.starts_with("path:"))),
        (400, Some(true))
    );
    let (s, _) = d.call(
        Method::POST,
        "/v1/images/import",
        Some(json!({"path": "/nonexistent/x"})),
    );
    assert_eq!(s, 422);
    wait_for("nothing pending", 5, || {
        std::fs::read_dir(d.state.join("images/tmp"))
            .expect("tmp")
            .count()
            == 0
    });
}

#[test]
fn templates_resolve_through_the_config_table() {
    if !require_registry("templates_resolve_through_the_config_table") {
        return;
    }
    let tmp = tempfile::tempdir().expect("tmp");
    let cfg = tmp.path().join("config.toml");
    std::fs::write(
        &cfg,
        format!(
            "insecure-registry = [\"{r}\"]\n[templates.python]\nimage = \"{p}\"\nuser = \"1000:1000\"\nworkdir = \"/work\"\n[templates.tiny]\nimage = \"{b}\"\nuser = \"0:0\"\n",
            r = registry(),
            p = python(),
            b = busybox()
        ),
    )
    .expect("config");
    let d = Daemon::start(&["--config", cfg.to_str().expect("utf8")]);
    let (_, v) = d.call(Method::GET, "/v1/templates", None);
    let names: Vec<&str> = v["templates"]
        .as_array()
        .expect("list")
        .iter()
        .filter_map(|t| t["name"].as_str())
        .collect();
    assert_eq!(names, vec!["python", "tiny"]);
    let id = d.create(json!({"template": "tiny"}));
    assert_eq!(d.sh(&id, "id -u; pwd")["stdout"], "0\n/work\n");
    let (_, run) = d.call(Method::GET, &format!("/v1/runs/{id}"), None);
    assert_eq!(
        (run["template"].as_str(), run["image"].as_str()),
        (Some("tiny"), Some(busybox().as_str()))
    );
    // Even as uid 0 the run has no capabilities, and cannot overwrite its
    // init through /proc/1/exe.
    assert_eq!(
        d.sh(&id, "grep CapEff /proc/self/status")["stdout"],
        "CapEff:\t0000000000000000\n"
    );
    let v = d.sh(&id, "echo x > /proc/1/exe; echo rc=$?");
    assert_eq!(v["stdout"], "rc=1\n", "{v}");
    let init = std::fs::read(d.state.join("bin/sbx-init")).expect("init");
    assert_eq!(&init[..4], b"\x7fELF");
}

/// Writes an OCI layout with one uncompressed layer built by `layer`.
fn oci_layout(dir: &std::path::Path, layer: impl FnOnce(&mut tar::Builder<Vec<u8>>)) {
    use sha2::Digest;
    let blobs = dir.join("blobs/sha256");
    std::fs::create_dir_all(&blobs).expect("blobs");
    let put = |bytes: &[u8]| -> (String, usize) {
        let hex = format!("{:x}", sha2::Sha256::digest(bytes));
        std::fs::write(blobs.join(&hex), bytes).expect("blob");
        (format!("sha256:{hex}"), bytes.len())
    };
    let mut b = tar::Builder::new(Vec::new());
    layer(&mut b);
    let (layer_digest, layer_size) = put(&b.into_inner().expect("tar"));
    let config = json!({"architecture": "amd64", "os": "linux", "config": {},
        "rootfs": {"type": "layers", "diff_ids": [layer_digest]}});
    let (config_digest, config_size) = put(config.to_string().as_bytes());
    let manifest = json!({"schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": config_digest, "size": config_size},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar",
                    "digest": layer_digest, "size": layer_size}]});
    let (manifest_digest, manifest_size) = put(manifest.to_string().as_bytes());
    let index = json!({"schemaVersion": 2, "manifests": [{
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "digest": manifest_digest, "size": manifest_size,
        "annotations": {"org.opencontainers.image.ref.name": "1"}}]});
    std::fs::write(dir.join("index.json"), index.to_string()).expect("index");
    std::fs::write(dir.join("oci-layout"), r#"{"imageLayoutVersion":"1.0.0"}"#).expect("layout");
}

#[test]
fn an_image_whose_paths_lead_out_of_its_root_never_touches_the_host() {
    if !common::require_root("an_image_whose_paths_lead_out_of_its_root_never_touches_the_host") {
        return;
    }
    // /work -> /etc and /srv -> /etc: preparing the run must not touch the
    // host's /etc through either.
    let tmp = tempfile::tempdir().expect("tmp");
    oci_layout(tmp.path(), |b| {
        for name in ["work", "srv"] {
            let mut h = tar::Header::new_gnu();
            h.set_entry_type(tar::EntryType::Symlink);
            h.set_size(0);
            h.set_mode(0o777);
            b.append_link(&mut h, name, "/etc").expect("symlink");
        }
    });
    let d = Daemon::start(&[]);
    let (s, v) = d.call(
        Method::POST,
        "/v1/images/import",
        Some(json!({"path": tmp.path(), "reference": "local/evil:1"})),
    );
    assert_eq!(s, 201, "{v}");
    let etc_before = std::fs::metadata("/etc").expect("etc");
    let etc_unchanged = || {
        let etc_after = std::fs::metadata("/etc").expect("etc");
        assert_eq!(
            (etc_before.uid(), etc_before.permissions().mode()),
            (etc_after.uid(), etc_after.permissions().mode()),
            "the host's /etc was touched"
        );
    };

    // /work is the run's own: a directory laid over the image's symlink,
    // owned by the run's user; a file written there stays in the run.
    let (s, v) = d.call(
        Method::POST,
        "/v1/runs",
        Some(json!({"image": "local/evil:1"})),
    );
    assert_eq!(s, 201, "{v}");
    let id = v["id"].as_str().expect("id").to_string();
    let work = d.state.join("runs").join(&id).join("rootfs/work");
    let meta = std::fs::symlink_metadata(&work).expect("work");
    assert!(meta.is_dir(), "/work is not a directory: {meta:?}");
    assert_eq!((meta.uid(), meta.gid()), (1000, 1000));
    let probe = format!("sbx-e2e-probe-{id}");
    let r = d
        .req(Method::PUT, &format!("/v1/runs/{id}/files/{probe}"))
        .body("inside")
        .send()
        .expect("put");
    assert!(r.status().is_success(), "{}", r.status());
    assert_eq!(
        std::fs::read_to_string(work.join(&probe)).expect("probe"),
        "inside"
    );
    assert!(
        !std::path::Path::new("/etc").join(&probe).exists(),
        "written to the host's /etc"
    );
    etc_unchanged();
    let (s, v) = d.call(Method::DELETE, &format!("/v1/runs/{id}?purge=true"), None);
    assert!(s < 300, "{s} {v}");

    // A workdir through the other symlink is refused — after the shim was
    // forked (it is, while the root is laid out) — and leaves nothing.
    let (s, v) = d.call(
        Method::POST,
        "/v1/runs",
        Some(json!({"image": "local/evil:1", "workdir": "/srv/app"})),
    );
    assert_eq!(s, 422, "{v}");
    assert!(
        v["message"]
            .as_str()
            .is_some_and(|m| m.contains("root cannot be used")),
        "{v}"
    );
    etc_unchanged();
    assert!(
        !std::path::Path::new("/etc/app").exists(),
        "made in the host's /etc"
    );
    let (_, list) = d.call(Method::GET, "/v1/runs", None);
    let failed: Vec<String> = list["runs"]
        .as_array()
        .expect("runs")
        .iter()
        .filter(|r| r["status"] == "error")
        .filter_map(|r| r["id"].as_str().map(str::to_string))
        .collect();
    assert_eq!(failed.len(), 1, "{list}");
    d.wait_nothing_left(&failed[0], 5);
}
