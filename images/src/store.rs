//! The content-addressed image store under `<state>/images`:
//!
//! ```text
//! layers/<sha256-hex>/   one unpacked layer, shared by every image and run
//! refs/<sha256(ref)>.json an image: its reference, manifest digest, layers, config
//! tmp/                    downloads and unpacks in progress (cleared at start)
//! ```
//!
//! A layer appears under `layers/` only by an atomic rename of a complete
//! unpack, so a failed or interrupted pull leaves nothing half-registered,
//! and two pulls of one layer (in this process or another) never race: the
//! loser of the rename discards its copy.

use std::collections::{BTreeSet, HashMap};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use futures_util::StreamExt;
use oci_client::manifest::{
    OciDescriptor, IMAGE_DOCKER_LAYER_GZIP_MEDIA_TYPE, IMAGE_LAYER_GZIP_MEDIA_TYPE,
    IMAGE_LAYER_MEDIA_TYPE,
};
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::unpack::{self, Limits};

#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("{reference:?} is not a valid image reference: {reason}")]
    BadReference { reference: String, reason: String },
    #[error("pull {reference}: {reason}")]
    Pull { reference: String, reason: String },
    #[error("layer {digest}: unsupported media type {media_type}")]
    MediaType { digest: String, media_type: String },
    #[error("layer {digest}")]
    Unpack {
        digest: String,
        #[source]
        source: unpack::UnpackError,
    },
    #[error("layer {digest}: digest mismatch")]
    Digest { digest: String },
    #[error("image {0} is not in the store")]
    NotFound(String),
    #[error("image {reference} is used by {runs} run(s)")]
    InUse { reference: String, runs: usize },
    #[error("import {path}: {reason}")]
    Import { path: PathBuf, reason: String },
    #[error("image store io at {path}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> ImageError + '_ {
    move |source| ImageError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// The parts of an image config a run uses.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct RunConfig {
    pub env: Vec<String>,
    pub working_dir: Option<String>,
    pub user: Option<String>,
}

/// One stored image.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ImageRecord {
    pub reference: String,
    pub digest: String,
    /// Layer digests, bottom first (`sha256:<hex>`).
    pub layers: Vec<String>,
    pub size_bytes: u64,
    pub config: RunConfig,
    pub stored_at_ms: i64,
}

/// Progress of a pull, for a bar on a terminal.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Progress {
    pub layer: String,
    pub done_bytes: u64,
    pub total_bytes: u64,
    pub phase: &'static str,
}

pub type ProgressFn = Arc<dyn Fn(Progress) + Send + Sync>;

#[derive(Debug, Clone, Default)]
pub struct PullOptions {
    pub insecure: Vec<String>,
    /// Registry host → (user, password), from the config file or a docker config.json.
    pub auth: HashMap<String, (String, String)>,
}

pub struct ImageStore {
    root: PathBuf,
    limits: Limits,
    /// In-process per-layer locks (the rename covers other processes).
    layer_locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

fn hex_of(digest: &str) -> Option<&str> {
    let h = digest.strip_prefix("sha256:")?;
    (h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit())).then_some(h)
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// Normalizes a user reference (`HOST[:PORT]/NAME[:TAG][@sha256:…]`).
pub fn parse_reference(s: &str) -> Result<Reference, ImageError> {
    s.parse::<Reference>()
        .map_err(|e| ImageError::BadReference {
            reference: s.to_string(),
            reason: e.to_string(),
        })
}

/// Credentials from a docker `config.json` (`auths.<host>.auth` = base64 user:pass).
pub fn docker_config_auth(text: &str) -> HashMap<String, (String, String)> {
    use base64::Engine;
    let mut out = HashMap::new();
    let Ok(v) = serde_json::from_str::<serde_json::Value>(text) else {
        return out;
    };
    if let Some(auths) = v["auths"].as_object() {
        for (host, a) in auths {
            let decoded = a["auth"]
                .as_str()
                .and_then(|s| base64::engine::general_purpose::STANDARD.decode(s).ok())
                .and_then(|b| String::from_utf8(b).ok());
            if let Some((u, p)) = decoded.as_deref().and_then(|d| d.split_once(':')) {
                let host = host
                    .trim_start_matches("https://")
                    .trim_start_matches("http://")
                    .trim_end_matches('/');
                out.insert(host.to_string(), (u.to_string(), p.to_string()));
            }
        }
    }
    out
}

enum Compression {
    None,
    Gzip,
    Zstd,
}

fn compression_of(media_type: &str, digest: &str) -> Result<Compression, ImageError> {
    match media_type {
        IMAGE_LAYER_MEDIA_TYPE | "application/vnd.docker.image.rootfs.diff.tar" => {
            Ok(Compression::None)
        }
        IMAGE_LAYER_GZIP_MEDIA_TYPE | IMAGE_DOCKER_LAYER_GZIP_MEDIA_TYPE => Ok(Compression::Gzip),
        "application/vnd.oci.image.layer.v1.tar+zstd" => Ok(Compression::Zstd),
        other => Err(ImageError::MediaType {
            digest: digest.to_string(),
            media_type: other.to_string(),
        }),
    }
}

/// Sniffs the compression of a local layer file (imports carry no media type).
fn sniff(path: &Path) -> std::io::Result<Compression> {
    let mut magic = [0u8; 4];
    let n = std::fs::File::open(path)?.read(&mut magic)?;
    Ok(match &magic[..n] {
        [0x1f, 0x8b, ..] => Compression::Gzip,
        [0x28, 0xb5, 0x2f, 0xfd] => Compression::Zstd,
        _ => Compression::None,
    })
}

fn parse_config(json: &str) -> RunConfig {
    let v: serde_json::Value = serde_json::from_str(json).unwrap_or_default();
    let c = &v["config"];
    RunConfig {
        env: c["Env"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|e| e.as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default(),
        working_dir: c["WorkingDir"]
            .as_str()
            .filter(|s| !s.is_empty())
            .map(str::to_string),
        user: c["User"]
            .as_str()
            .filter(|s| !s.is_empty())
            .map(str::to_string),
    }
}

impl ImageStore {
    pub fn open(root: &Path, limits: Limits) -> Result<ImageStore, ImageError> {
        for d in ["layers", "refs", "tmp"] {
            std::fs::create_dir_all(root.join(d)).map_err(io_err(root))?;
        }
        // Layers are unpacked under tmp/ and renamed into layers/.
        spread_subdirectories(&root.join("tmp"));
        // Whatever was in flight when a previous daemon died is garbage.
        if let Ok(rd) = std::fs::read_dir(root.join("tmp")) {
            for e in rd.flatten() {
                let _ =
                    std::fs::remove_dir_all(e.path()).or_else(|_| std::fs::remove_file(e.path()));
            }
        }
        Ok(ImageStore {
            root: root.to_path_buf(),
            limits,
            layer_locks: Mutex::new(HashMap::new()),
        })
    }

    pub fn layer_dir(&self, digest: &str) -> Option<PathBuf> {
        hex_of(digest).map(|h| self.root.join("layers").join(h))
    }

    /// Records are keyed by the normalized reference, so `busybox:1` and
    /// `docker.io/library/busybox:1` name the same image.
    fn ref_path(&self, reference: &str) -> PathBuf {
        let key = parse_reference(reference)
            .map(|r| r.whole())
            .unwrap_or_else(|_| reference.to_string());
        let h = Sha256::digest(key.as_bytes());
        self.root
            .join("refs")
            .join(format!("{}.json", hex::encode(h)))
    }

    fn tmp_path(&self, what: &str) -> PathBuf {
        self.root
            .join("tmp")
            .join(format!("{what}-{:016x}", rand_u64()))
    }

    pub fn get(&self, reference: &str) -> Option<ImageRecord> {
        let text = std::fs::read(self.ref_path(reference)).ok()?;
        let rec: ImageRecord = serde_json::from_slice(&text).ok()?;
        // Only complete when every layer is present.
        rec.layers
            .iter()
            .all(|l| self.layer_dir(l).is_some_and(|d| d.is_dir()))
            .then_some(rec)
    }

    pub fn list(&self) -> Vec<ImageRecord> {
        let mut out: Vec<ImageRecord> = std::fs::read_dir(self.root.join("refs"))
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| std::fs::read(e.path()).ok())
            .filter_map(|b| serde_json::from_slice(&b).ok())
            .collect();
        out.sort_by(|a, b| a.reference.cmp(&b.reference));
        out
    }

    fn put(&self, rec: &ImageRecord) -> Result<(), ImageError> {
        let path = self.ref_path(&rec.reference);
        let tmp = self.tmp_path("ref");
        let body = serde_json::to_vec_pretty(rec).map_err(|e| ImageError::Io {
            path: path.clone(),
            source: e.into(),
        })?;
        std::fs::write(&tmp, body).map_err(io_err(&tmp))?;
        std::fs::rename(&tmp, &path).map_err(io_err(&path))
    }

    /// Removes an image record; layers go at the next [`ImageStore::gc`].
    pub fn remove(&self, reference: &str) -> Result<(), ImageError> {
        match std::fs::remove_file(self.ref_path(reference)) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                Err(ImageError::NotFound(reference.to_string()))
            }
            Err(e) => Err(ImageError::Io {
                path: self.ref_path(reference),
                source: e,
            }),
        }
    }

    /// Deletes every layer that no image references and `in_use` does not name.
    pub fn gc(&self, in_use: &BTreeSet<PathBuf>) -> Result<Vec<String>, ImageError> {
        let referenced: BTreeSet<PathBuf> = self
            .list()
            .iter()
            .flat_map(|r| r.layers.iter().filter_map(|l| self.layer_dir(l)))
            .collect();
        let mut removed = Vec::new();
        let layers = self.root.join("layers");
        for e in std::fs::read_dir(&layers)
            .map_err(io_err(&layers))?
            .flatten()
        {
            let p = e.path();
            if referenced.contains(&p) || in_use.contains(&p) {
                continue;
            }
            let hex = e.file_name().to_string_lossy().into_owned();
            // Move out of the namespace first so a crash never leaves half a layer visible.
            let doomed = self.tmp_path("gc");
            if std::fs::rename(&p, &doomed).is_ok() {
                let _ = std::fs::remove_dir_all(&doomed);
                removed.push(format!("sha256:{hex}"));
            }
        }
        Ok(removed)
    }

    fn lock_for(&self, digest: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut m = self.layer_locks.lock().unwrap_or_else(|e| e.into_inner());
        m.entry(digest.to_string()).or_default().clone()
    }

    /// Unpacks a verified blob file into the store under `digest`; blocking.
    fn register_layer(
        &self,
        digest: &str,
        blob: &Path,
        compression: Compression,
    ) -> Result<(), ImageError> {
        let file = std::fs::File::open(blob).map_err(io_err(blob))?;
        let file = std::io::BufReader::with_capacity(1 << 20, file);
        self.register_stream(digest, file, compression, None)
    }

    /// Unpacks a layer from `src` into the store. With `verdict`, the layer
    /// is kept only once the sender says the bytes were the right ones (a
    /// layer streamed off the network is unpacked while it arrives, and its
    /// digest is known only at the end).
    fn register_stream(
        &self,
        digest: &str,
        src: impl Read + Send + 'static,
        compression: Compression,
        verdict: Option<std::sync::mpsc::Receiver<Result<(), String>>>,
    ) -> Result<(), ImageError> {
        let Some(final_dir) = self.layer_dir(digest) else {
            return Err(ImageError::Digest {
                digest: digest.to_string(),
            });
        };
        if final_dir.is_dir() {
            return Ok(());
        }
        let staging = self.tmp_path("layer");
        std::fs::create_dir(&staging).map_err(io_err(&staging))?;
        // Inflate on a thread of its own so decompression and file writes overlap.
        let result = match compression {
            Compression::None => unpack::unpack(src, &staging, self.limits),
            Compression::Gzip => unpack::unpack(
                pipelined(flate2::read::GzDecoder::new(src)),
                &staging,
                self.limits,
            ),
            Compression::Zstd => match zstd::stream::read::Decoder::new(src) {
                Ok(d) => unpack::unpack(pipelined(d), &staging, self.limits),
                Err(e) => Err(unpack::UnpackError::Read(e)),
            },
        };
        let result = result.map_err(|source| ImageError::Unpack {
            digest: digest.to_string(),
            source,
        });
        let result = result.and_then(|_stats| match verdict.map(|v| v.recv()) {
            None | Some(Ok(Ok(()))) => Ok(()),
            Some(Ok(Err(reason))) => Err(ImageError::Digest {
                digest: format!("{digest} ({reason})"),
            }),
            Some(Err(_)) => Err(ImageError::Digest {
                digest: format!("{digest} (download ended without a verdict)"),
            }),
        });
        if let Err(e) = result {
            let _ = std::fs::remove_dir_all(&staging);
            return Err(e);
        }
        match std::fs::rename(&staging, &final_dir) {
            Ok(()) => Ok(()),
            // Someone else registered it first; theirs is as good as ours.
            Err(_) if final_dir.is_dir() => {
                let _ = std::fs::remove_dir_all(&staging);
                Ok(())
            }
            Err(e) => {
                let _ = std::fs::remove_dir_all(&staging);
                Err(ImageError::Io {
                    path: final_dir,
                    source: e,
                })
            }
        }
    }

    /// Pulls `reference` from its registry: index resolved to linux/amd64,
    /// layers fetched in parallel, digests verified, each layer unpacked once.
    pub async fn pull(
        self: &Arc<Self>,
        reference: &str,
        opts: &PullOptions,
        progress: Option<ProgressFn>,
    ) -> Result<ImageRecord, ImageError> {
        let r = parse_reference(reference)?;
        let perr = |reason: String| ImageError::Pull {
            reference: reference.to_string(),
            reason,
        };
        let client = Client::new(oci_client::client::ClientConfig {
            protocol: oci_client::client::ClientProtocol::HttpsExcept(opts.insecure.clone()),
            platform_resolver: Some(Box::new(oci_client::client::linux_amd64_resolver)),
            max_concurrent_download: 8,
            ..Default::default()
        });
        let auth = match opts
            .auth
            .get(r.resolve_registry())
            .or_else(|| opts.auth.get(r.registry()))
        {
            Some((u, p)) => RegistryAuth::Basic(u.clone(), p.clone()),
            None => RegistryAuth::Anonymous,
        };
        let (manifest, digest, config) = client
            .pull_manifest_and_config(&r, &auth)
            .await
            .map_err(|e| perr(e.to_string()))?;
        let config = parse_config(&config);
        let mut tasks = Vec::new();
        for layer in manifest.layers.clone() {
            let (store, client, r, progress) =
                (self.clone(), client.clone(), r.clone(), progress.clone());
            tasks.push(tokio::spawn(async move {
                store.fetch_layer(&client, &r, &layer, progress).await
            }));
        }
        let mut size = 0;
        for t in tasks {
            size += t.await.map_err(|e| perr(e.to_string()))??;
        }
        let rec = ImageRecord {
            reference: reference.to_string(),
            digest,
            layers: manifest.layers.iter().map(|l| l.digest.clone()).collect(),
            size_bytes: size,
            config,
            stored_at_ms: now_ms(),
        };
        self.put(&rec)?;
        Ok(rec)
    }

    async fn fetch_layer(
        self: &Arc<Self>,
        client: &Client,
        r: &Reference,
        layer: &OciDescriptor,
        progress: Option<ProgressFn>,
    ) -> Result<u64, ImageError> {
        let digest = layer.digest.clone();
        let Some(final_dir) = self.layer_dir(&digest) else {
            return Err(ImageError::Digest { digest });
        };
        let compression = compression_of(&layer.media_type, &digest)?;
        let lock = self.lock_for(&digest);
        let _held = lock.lock().await;
        let total = layer.size.max(0) as u64;
        if final_dir.is_dir() {
            if let Some(p) = &progress {
                p(Progress {
                    layer: digest.clone(),
                    done_bytes: total,
                    total_bytes: total,
                    phase: "exists",
                });
            }
            return Ok(total);
        }
        // Streamed: the layer is inflated and unpacked while it downloads;
        // oci-client's verifying stream fails at the end if the digest is
        // not the layer's, and the unpacked tree is kept only if it passed.
        let t0 = std::time::Instant::now();
        let mut stream = client
            .pull_blob_stream(r, layer)
            .await
            .map_err(|e| ImageError::Pull {
                reference: r.whole(),
                reason: format!("layer {digest}: {e}"),
            })?
            .stream;
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        let (vtx, vrx) = std::sync::mpsc::sync_channel(1);
        let (store, d) = (self.clone(), digest.clone());
        let unpacking = tokio::task::spawn_blocking(move || {
            let src = ChunkReader::new(rx);
            store.register_stream(&d, src, compression, Some(vrx))
        });
        let mut done: u64 = 0;
        let mut fetched: Result<(), String> = Ok(());
        // Read to the end even when the unpacker stopped early (the tar
        // ended before the compressed stream): the verdict needs the digest.
        while let Some(chunk) = stream.next().await {
            match chunk {
                Ok(c) => {
                    let before = done >> 20;
                    done += c.len() as u64;
                    if let Some(p) = &progress {
                        if done >> 20 != before {
                            p(Progress {
                                layer: digest.clone(),
                                done_bytes: done,
                                total_bytes: total,
                                phase: "fetching",
                            });
                        }
                    }
                    let _ = tx.send(Ok(c)).await;
                }
                Err(e) => {
                    fetched = Err(e.to_string());
                    break;
                }
            }
        }
        drop(tx);
        let t_fetch = t0.elapsed();
        let _ = vtx.send(fetched.clone());
        let t1 = std::time::Instant::now();
        let res = unpacking.await.map_err(|e| ImageError::Pull {
            reference: r.whole(),
            reason: e.to_string(),
        })?;
        if let Err(reason) = fetched {
            return Err(ImageError::Pull {
                reference: r.whole(),
                reason: format!("layer {digest}: {reason}"),
            });
        }
        res?;
        tracing::debug!(layer = %digest, bytes = total, fetch_ms = t_fetch.as_millis() as u64, unpack_tail_ms = t1.elapsed().as_millis() as u64, "layer stored");
        if let Some(p) = &progress {
            p(Progress {
                layer: digest,
                done_bytes: total,
                total_bytes: total,
                phase: "done",
            });
        }
        Ok(total)
    }

    /// Imports an OCI image layout directory, or a `docker save` archive
    /// (either a tar file or its unpacked directory); blocking.
    pub fn import(
        &self,
        path: &Path,
        reference: Option<&str>,
    ) -> Result<Vec<ImageRecord>, ImageError> {
        let ierr = |reason: String| ImageError::Import {
            path: path.to_path_buf(),
            reason,
        };
        let (dir, _cleanup) = if path.is_dir() {
            (path.to_path_buf(), None)
        } else {
            let staging = self.tmp_path("import");
            std::fs::create_dir(&staging).map_err(io_err(&staging))?;
            let cleanup = RemoveOnDrop(staging.clone());
            let f = std::fs::File::open(path).map_err(|e| ierr(e.to_string()))?;
            let mut a = tar::Archive::new(std::io::BufReader::new(f));
            a.set_preserve_permissions(false);
            // tar::Archive::unpack refuses entries that would leave `staging`.
            a.unpack(&staging)
                .map_err(|e| ierr(format!("not a tar archive: {e}")))?;
            (staging, Some(cleanup))
        };
        let read_json = |p: PathBuf| -> Result<serde_json::Value, ImageError> {
            let b = std::fs::read(&p).map_err(|e| ierr(format!("{}: {e}", p.display())))?;
            serde_json::from_slice(&b).map_err(|e| ierr(format!("{}: {e}", p.display())))
        };
        let blob = |digest: &str| -> Result<PathBuf, ImageError> {
            let hex = hex_of(digest).ok_or_else(|| ierr(format!("bad digest {digest}")))?;
            Ok(dir.join("blobs/sha256").join(hex))
        };
        // (reference, config path, layer paths bottom first)
        let mut images: Vec<(String, PathBuf, Vec<PathBuf>)> = Vec::new();
        if dir.join("manifest.json").is_file() {
            let m = read_json(dir.join("manifest.json"))?;
            for (i, item) in m.as_array().cloned().unwrap_or_default().iter().enumerate() {
                let tag = item["RepoTags"][0].as_str().map(str::to_string);
                let name = reference
                    .map(str::to_string)
                    .or(tag)
                    .ok_or_else(|| ierr(format!("image {i} has no tag; give a reference")))?;
                let config = dir.join(
                    item["Config"]
                        .as_str()
                        .ok_or_else(|| ierr("manifest without Config".into()))?,
                );
                let layers = item["Layers"]
                    .as_array()
                    .ok_or_else(|| ierr("manifest without Layers".into()))?
                    .iter()
                    .map(|l| {
                        l.as_str()
                            .map(|s| dir.join(s))
                            .ok_or_else(|| ierr("bad layer path".into()))
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                images.push((name, config, layers));
            }
        } else if dir.join("index.json").is_file() {
            let index = read_json(dir.join("index.json"))?;
            for (i, desc) in index["manifests"]
                .as_array()
                .cloned()
                .unwrap_or_default()
                .iter()
                .enumerate()
            {
                let name = reference
                    .map(str::to_string)
                    .or_else(|| {
                        desc["annotations"]["io.containerd.image.name"]
                            .as_str()
                            .map(str::to_string)
                    })
                    .or_else(|| {
                        desc["annotations"]["org.opencontainers.image.ref.name"]
                            .as_str()
                            .map(|t| format!("local/image:{t}"))
                    })
                    .ok_or_else(|| ierr(format!("manifest {i} has no name; give a reference")))?;
                let m = read_json(blob(desc["digest"].as_str().unwrap_or_default())?)?;
                let config = blob(m["config"]["digest"].as_str().unwrap_or_default())?;
                let layers = m["layers"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default()
                    .iter()
                    .map(|l| blob(l["digest"].as_str().unwrap_or_default()))
                    .collect::<Result<Vec<_>, _>>()?;
                images.push((name, config, layers));
            }
        } else {
            return Err(ierr(
                "neither manifest.json (docker save) nor index.json (OCI layout)".into(),
            ));
        }
        let mut out = Vec::new();
        for (name, config, layers) in images {
            parse_reference(&name)?;
            let mut digests = Vec::new();
            let mut size = 0;
            for l in &layers {
                let mut f =
                    std::fs::File::open(l).map_err(|e| ierr(format!("{}: {e}", l.display())))?;
                let mut h = Sha256::new();
                size += std::io::copy(&mut f, &mut h).map_err(io_err(l))?;
                let digest = format!("sha256:{}", hex::encode(h.finalize()));
                // An OCI layout names blobs by digest: check they match.
                if l.parent().is_some_and(|p| p.ends_with("blobs/sha256"))
                    && l.file_name().map(|n| n.to_string_lossy().into_owned())
                        != hex_of(&digest).map(str::to_string)
                {
                    return Err(ImageError::Digest { digest });
                }
                let c = sniff(l).map_err(io_err(l))?;
                self.register_layer(&digest, l, c)?;
                digests.push(digest);
            }
            let cfg_text = std::fs::read_to_string(&config)
                .map_err(|e| ierr(format!("{}: {e}", config.display())))?;
            let rec = ImageRecord {
                reference: name,
                digest: format!(
                    "sha256:{}",
                    hex::encode(Sha256::digest(cfg_text.as_bytes()))
                ),
                layers: digests,
                size_bytes: size,
                config: parse_config(&cfg_text),
                stored_at_ms: now_ms(),
            };
            self.put(&rec)?;
            out.push(rec);
        }
        Ok(out)
    }
}

/// Marks `dir` as a top of directory hierarchies (`chattr +T`): ext4 then
/// places each new subdirectory, and the files in it, in a block group of
/// its own choosing (Orlov) instead of next to its parent. Without it, an
/// unpack right after a large delete (a layer or a container removed) ran
/// 3-6x slower here: the inode allocator scans past every recently deleted
/// inode of the parent's group (`recently_deleted`, 9.4 of 10.1 s in the
/// kernel for the python layer, against 1.7 s with the flag). Filesystems
/// without the flag ignore it; failing to set it only costs speed.
pub fn spread_subdirectories(dir: &Path) {
    let Ok(f) = std::fs::File::open(dir) else {
        return;
    };
    if let Ok(flags) = rustix::fs::ioctl_getflags(&f) {
        if !flags.contains(rustix::fs::IFlags::TOPDIR) {
            let _ = rustix::fs::ioctl_setflags(&f, flags | rustix::fs::IFlags::TOPDIR);
        }
    }
}

/// A blocking reader over chunks another task or thread sends: a download
/// (an async task) or an inflate thread reading ahead ([`pipelined`]). An
/// `Err` chunk is returned as the read error; the sender gone is the end (a
/// failed download says so through its verdict).
struct ChunkReader {
    rx: tokio::sync::mpsc::Receiver<std::io::Result<bytes::Bytes>>,
    buf: bytes::Bytes,
}

impl ChunkReader {
    fn new(rx: tokio::sync::mpsc::Receiver<std::io::Result<bytes::Bytes>>) -> ChunkReader {
        ChunkReader {
            rx,
            buf: bytes::Bytes::new(),
        }
    }
}

impl Read for ChunkReader {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        while self.buf.is_empty() {
            match self.rx.blocking_recv() {
                Some(chunk) => self.buf = chunk?,
                None => return Ok(0),
            }
        }
        let n = out.len().min(self.buf.len());
        out[..n].copy_from_slice(&self.buf[..n]);
        bytes::Buf::advance(&mut self.buf, n);
        Ok(n)
    }
}

/// A reader fed by a thread of its own that reads `src` ahead in 1 MiB chunks.
fn pipelined(mut src: impl Read + Send + 'static) -> ChunkReader {
    let (tx, rx) = tokio::sync::mpsc::channel(8);
    std::thread::spawn(move || loop {
        // read_to_end fills spare capacity without zeroing it first (a
        // zeroed 1 MiB per chunk was 9% of a pull's CPU in perf).
        let mut chunk = Vec::with_capacity(1 << 20);
        match (&mut src).take(1 << 20).read_to_end(&mut chunk) {
            Ok(0) => return,
            // The reader gave up (an unpack error): stop.
            Ok(_) => {
                if tx.blocking_send(Ok(bytes::Bytes::from(chunk))).is_err() {
                    return;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                let _ = tx.blocking_send(Err(e));
                return;
            }
        }
    });
    ChunkReader::new(rx)
}

struct RemoveOnDrop(PathBuf);
impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn rand_u64() -> u64 {
    let mut b = [0u8; 8];
    if std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .is_err()
    {
        b = (now_ms() as u64 ^ u64::from(std::process::id())).to_le_bytes();
    }
    u64::from_le_bytes(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits = Limits {
        max_bytes: 1 << 30,
        max_entries: 1 << 20,
    };

    fn layer_tar(files: &[(&str, &[u8])]) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        for (p, data) in files {
            let mut h = tar::Header::new_gnu();
            h.set_path(p).expect("path");
            h.set_size(data.len() as u64);
            h.set_mode(0o644);
            h.set_cksum();
            b.append(&h, *data).expect("append");
        }
        b.into_inner().expect("tar")
    }

    fn sha(b: &[u8]) -> String {
        hex::encode(Sha256::digest(b))
    }

    /// Writes an OCI layout with one image of two layers (one gzip).
    fn oci_layout(dir: &Path) -> (String, String) {
        let blobs = dir.join("blobs/sha256");
        std::fs::create_dir_all(&blobs).expect("blobs");
        let l1 = layer_tar(&[("a.txt", b"one")]);
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        std::io::Write::write_all(&mut gz, &layer_tar(&[("b.txt", b"two")])).expect("gz");
        let l2 = gz.finish().expect("gz");
        let cfg = br#"{"config":{"Env":["PATH=/usr/bin","LANG=C"],"WorkingDir":"/srv"}}"#;
        for b in [&l1[..], &l2[..], &cfg[..]] {
            std::fs::write(blobs.join(sha(b)), b).expect("blob");
        }
        let manifest = serde_json::json!({
            "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": format!("sha256:{}", sha(cfg)), "size": cfg.len()},
            "layers": [
                {"mediaType": IMAGE_LAYER_MEDIA_TYPE, "digest": format!("sha256:{}", sha(&l1)), "size": l1.len()},
                {"mediaType": IMAGE_LAYER_GZIP_MEDIA_TYPE, "digest": format!("sha256:{}", sha(&l2)), "size": l2.len()},
            ]
        });
        let mb = serde_json::to_vec(&manifest).expect("json");
        std::fs::write(blobs.join(sha(&mb)), &mb).expect("manifest");
        let index = serde_json::json!({"schemaVersion": 2, "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": format!("sha256:{}", sha(&mb)), "size": mb.len(),
            "annotations": {"org.opencontainers.image.ref.name": "v1"}}]});
        std::fs::write(
            dir.join("index.json"),
            serde_json::to_vec(&index).expect("json"),
        )
        .expect("index");
        std::fs::write(dir.join("oci-layout"), br#"{"imageLayoutVersion":"1.0.0"}"#)
            .expect("layout");
        (
            format!("sha256:{}", sha(&l1)),
            format!("sha256:{}", sha(&l2)),
        )
    }

    #[test]
    fn a_streamed_layer_is_kept_only_with_a_good_verdict() {
        let state = tempfile::tempdir().expect("tmp");
        let store = ImageStore::open(state.path(), LIMITS).expect("open");
        let tar = layer_tar(&[("x.txt", b"streamed")]);
        let digest = format!("sha256:{}", sha(&tar));
        let stream = |verdict: Result<(), String>| {
            let (tx, rx) = tokio::sync::mpsc::channel(4);
            let (vtx, vrx) = std::sync::mpsc::sync_channel(1);
            // The chunks, then the verdict, as a download would send them.
            let chunks: Vec<bytes::Bytes> =
                tar.chunks(700).map(bytes::Bytes::copy_from_slice).collect();
            let feeder = std::thread::spawn(move || {
                for c in chunks {
                    if tx.blocking_send(Ok(c)).is_err() {
                        break;
                    }
                }
                drop(tx);
                let _ = vtx.send(verdict);
            });
            let src = ChunkReader::new(rx);
            (src, vrx, feeder)
        };
        let (src, vrx, feeder) = stream(Err("digest mismatch".into()));
        let bad = store.register_stream(&digest, src, Compression::None, Some(vrx));
        feeder.join().expect("feeder");
        assert!(matches!(bad, Err(ImageError::Digest { .. })), "{bad:?}");
        let dir = store.layer_dir(&digest).expect("dir");
        assert!(!dir.exists(), "a layer that failed its check was kept");
        assert_eq!(
            std::fs::read_dir(state.path().join("tmp"))
                .expect("tmp")
                .count(),
            0
        );
        let (src, vrx, feeder) = stream(Ok(()));
        store
            .register_stream(&digest, src, Compression::None, Some(vrx))
            .expect("good layer");
        feeder.join().expect("feeder");
        assert_eq!(std::fs::read(dir.join("x.txt")).expect("file"), b"streamed");
    }

    #[test]
    fn imports_an_oci_layout_shares_layers_and_gcs() {
        let state = tempfile::tempdir().expect("state");
        let src = tempfile::tempdir().expect("src");
        let (l1, l2) = oci_layout(src.path());
        let store = ImageStore::open(state.path(), LIMITS).expect("open");
        let recs = store
            .import(src.path(), Some("local/test:1"))
            .expect("import");
        assert_eq!(recs[0].layers, vec![l1.clone(), l2.clone()]);
        assert_eq!(recs[0].config.env, vec!["PATH=/usr/bin", "LANG=C"]);
        assert_eq!(recs[0].config.working_dir.as_deref(), Some("/srv"));
        let d2 = store.layer_dir(&l2).expect("dir");
        assert_eq!(std::fs::read(d2.join("b.txt")).expect("b"), b"two");
        // A second name shares the layers.
        store
            .import(src.path(), Some("local/test:2"))
            .expect("again");
        assert_eq!(
            std::fs::read_dir(state.path().join("layers"))
                .expect("layers")
                .count(),
            2
        );
        assert_eq!(store.list().len(), 2);
        store.remove("local/test:1").expect("rm");
        assert!(
            store.gc(&BTreeSet::new()).expect("gc").is_empty(),
            "still referenced by :2"
        );
        store.remove("local/test:2").expect("rm");
        let in_use: BTreeSet<PathBuf> = [store.layer_dir(&l1).expect("l1")].into();
        assert_eq!(store.gc(&in_use).expect("gc"), vec![l2]);
        assert!(
            store.layer_dir(&l1).expect("l1").is_dir(),
            "in use by a run"
        );
        assert!(matches!(
            store.remove("local/test:2"),
            Err(ImageError::NotFound(_))
        ));
    }

    #[test]
    fn a_tampered_blob_is_refused_and_nothing_registered() {
        let state = tempfile::tempdir().expect("state");
        let src = tempfile::tempdir().expect("src");
        let (l1, _) = oci_layout(src.path());
        let path = src
            .path()
            .join("blobs/sha256")
            .join(hex_of(&l1).expect("hex"));
        let mut bytes = std::fs::read(&path).expect("read");
        bytes[600] ^= 1;
        std::fs::write(&path, bytes).expect("write");
        let store = ImageStore::open(state.path(), LIMITS).expect("open");
        assert!(matches!(
            store.import(src.path(), Some("x/y:z")),
            Err(ImageError::Digest { .. })
        ));
        assert!(store.list().is_empty());
        assert_eq!(
            std::fs::read_dir(state.path().join("layers"))
                .expect("layers")
                .count(),
            0
        );
    }

    #[test]
    fn docker_config_credentials() {
        let cfg = r#"{"auths": {"https://reg.example:5000/": {"auth": "dXNlcjpwYXNz"}}}"#;
        let m = docker_config_auth(cfg);
        assert_eq!(
            m.get("reg.example:5000"),
            Some(&("user".to_string(), "pass".to_string()))
        );
    }

    #[test]
    fn references_parse() {
        let r = parse_reference("127.0.0.1:5000/sbx/busybox:1").expect("ref");
        assert_eq!(
            (r.registry(), r.repository(), r.tag()),
            ("127.0.0.1:5000", "sbx/busybox", Some("1"))
        );
        assert!(parse_reference("UPPER/Case:x").is_err());
    }
}
