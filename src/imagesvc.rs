//! Images for the daemon: the built-in `host` image, and registry images
//! from the layer store (pulled on first use, like `docker run`).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use sbx_images::store::{ImageError, ImageRecord, ImageStore, ProgressFn, PullOptions};
use sbx_images::unpack::Limits;

use crate::config::Config;
use crate::runs::sandbox::Root;

pub struct Images {
    store: Arc<ImageStore>,
    opts: PullOptions,
    runs_dir: PathBuf,
}

/// The file in a run's directory naming the layers its root uses.
pub const RUN_LAYERS_FILE: &str = "layers.json";

impl Images {
    pub fn new(cfg: &Config, state_dir: &Path) -> Result<Images, ImageError> {
        let store = ImageStore::open(
            &state_dir.join("images"),
            Limits {
                max_bytes: cfg.unpack_max_bytes,
                max_entries: cfg.unpack_max_entries,
            },
        )?;
        let mut auth = std::collections::HashMap::new();
        for p in ["/root/.docker/config.json", "/etc/sbx/docker-config.json"] {
            if let Ok(text) = std::fs::read_to_string(p) {
                auth.extend(sbx_images::store::docker_config_auth(&text));
            }
        }
        for (host, a) in &cfg.registry_auth {
            auth.insert(host.clone(), (a.username.clone(), a.password.clone()));
        }
        Ok(Images {
            store: Arc::new(store),
            opts: PullOptions {
                insecure: cfg.insecure_registries.clone(),
                auth,
            },
            runs_dir: state_dir.join("runs"),
        })
    }

    /// The root a run of `image` gets; an error is a 422 for the client.
    pub async fn root_for(&self, image: &str) -> Result<Root, String> {
        if image == crate::runs::model::HOST_IMAGE {
            return Ok(Root::Host);
        }
        let rec = match self.store.get(image) {
            Some(r) => r,
            None => self
                .store
                .pull(image, &self.opts, None)
                .await
                .map_err(|e| format!("{:#}", anyhow::Error::from(e)))?,
        };
        let layers: Vec<PathBuf> = rec
            .layers
            .iter()
            .rev()
            .filter_map(|l| self.store.layer_dir(l))
            .collect();
        let env = rec
            .config
            .env
            .iter()
            .filter_map(|e| {
                e.split_once('=')
                    .map(|(k, v)| (k.to_string(), v.to_string()))
            })
            .collect();
        Ok(Root::Layers { layers, env })
    }

    pub async fn pull(
        &self,
        reference: &str,
        progress: Option<ProgressFn>,
    ) -> Result<ImageRecord, ImageError> {
        self.store.pull(reference, &self.opts, progress).await
    }

    pub async fn import(
        &self,
        path: PathBuf,
        reference: Option<String>,
    ) -> Result<Vec<ImageRecord>, ImageError> {
        let store = self.store.clone();
        tokio::task::spawn_blocking(move || store.import(&path, reference.as_deref()))
            .await
            .map_err(|e| ImageError::Import {
                path: PathBuf::new(),
                reason: e.to_string(),
            })?
    }

    pub fn list(&self) -> Vec<ImageRecord> {
        self.store.list()
    }

    /// Removes the image and garbage-collects layers nothing uses any more.
    pub async fn remove(&self, reference: &str) -> Result<Vec<String>, ImageError> {
        self.store.remove(reference)?;
        self.gc().await
    }

    /// Layers used by no image and no run are deleted.
    pub async fn gc(&self) -> Result<Vec<String>, ImageError> {
        let (store, runs_dir) = (self.store.clone(), self.runs_dir.clone());
        tokio::task::spawn_blocking(move || store.gc(&layers_in_use(&runs_dir)))
            .await
            .map_err(|e| ImageError::Import {
                path: PathBuf::new(),
                reason: e.to_string(),
            })?
    }
}

fn layers_in_use(runs_dir: &Path) -> BTreeSet<PathBuf> {
    let mut out = BTreeSet::new();
    for e in std::fs::read_dir(runs_dir).into_iter().flatten().flatten() {
        if let Ok(b) = std::fs::read(e.path().join(RUN_LAYERS_FILE)) {
            if let Ok(v) = serde_json::from_slice::<Vec<PathBuf>>(&b) {
                out.extend(v);
            }
        }
    }
    out
}
