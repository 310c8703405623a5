//! `sbx serve`: config, state dir, token, registry, reaper, HTTP, and a
//! bounded graceful shutdown.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use sha2::Digest;

use crate::api::{self, AppState};
use crate::config::{Config, ServeFlags};
use crate::runs::sandbox::Host;
use crate::runs::Runs;

/// Reads the token, minting a random one (0600) on first start.
pub fn load_or_mint_token(path: &Path) -> anyhow::Result<String> {
    match std::fs::read_to_string(path) {
        Ok(t) if !t.trim().is_empty() => return Ok(t.trim().to_string()),
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("read token {}", path.display())),
    }
    let bytes: [u8; 32] = rand::random();
    let token: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    crate::seal::write_private(path, token.as_bytes())
        .with_context(|| format!("write token {}", path.display()))?;
    eprintln!("sbx: minted a new API token at {}", path.display());
    Ok(token)
}

/// `/sbx-<8 hex>`: derived from the state dir so two daemons never share it.
pub fn cgroup_parent(state_dir: &Path) -> String {
    let h = sha2::Sha256::digest(state_dir.as_os_str().as_encoded_bytes());
    format!(
        "/sbx-{}",
        h.iter()
            .take(4)
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
    )
}

pub fn serve(flags: ServeFlags) -> anyhow::Result<()> {
    let vars: BTreeMap<String, String> = std::env::vars().collect();
    let cfg = Config::load(&flags, &vars)?;
    if !nix::unistd::geteuid().is_root() {
        anyhow::bail!("sbx serve must run as root (namespaces, cgroups and mounts need it)");
    }
    std::fs::create_dir_all(&cfg.state_dir)
        .with_context(|| format!("create {}", cfg.state_dir.display()))?;
    let state_dir = cfg.state_dir.canonicalize()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(run(cfg, state_dir))
}

async fn run(cfg: Config, state_dir: std::path::PathBuf) -> anyhow::Result<()> {
    let _ = crate::SERVER_NAME.set(cfg.server_name.clone());
    let token = load_or_mint_token(&state_dir.join("token"))?;
    let layout = sbx_runtime::Layout::detect()?;
    if cfg.cgroup_favordynmods {
        // Without it each create and exec waits out an RCU grace period
        // when it moves a process into a cgroup (see favor_dynmods).
        match sbx_runtime::cgroups::favor_dynmods() {
            Ok(done) => tracing::info!(?done, "cgroup favordynmods"),
            Err(e) => tracing::warn!(
                error = %e,
                "could not set favordynmods on cgroup2; moving a process into a cgroup stays slow"
            ),
        }
    }
    // Shims and exec helpers are this binary; resolve it once.
    let self_exe = std::fs::canonicalize("/proc/self/exe")?;
    let init_binary = sbx_runtime::init::install(&state_dir.join("bin"))?;
    crate::runs::sandbox::install_skeleton(&state_dir)?;
    // Compiled once: an exec loads the program instead of building it (~1 ms).
    let seccomp = match sbx_runtime::seccomp::export_bpf() {
        Ok(prog) => {
            let path = state_dir.join("bin/seccomp.bpf");
            sbx_runtime::write_atomic(&path, &prog)?;
            Some(crate::runs::sandbox::Seccomp {
                path,
                program: Arc::new(prog),
            })
        }
        Err(e) => {
            tracing::warn!(error = %e, "precompiling seccomp failed; each exec compiles it");
            None
        }
    };
    let zygote = Arc::new(crate::runs::sandbox::ShimZygote::new(
        self_exe.clone(),
        state_dir.clone(),
    ));
    zygote.start().await;
    let host = Arc::new(Host {
        cgroup_parent: cgroup_parent(&state_dir),
        state_dir: state_dir.clone(),
        layout,
        self_exe,
        init_binary,
        seccomp,
        zygote,
        spares: Arc::new(crate::runs::sandbox::SpareDirs::new(
            crate::runs::sandbox::runs_dir(&state_dir),
        )),
    });
    sbx_runtime::cgroups::create(&host.layout, &host.cgroup_parent)?;
    if !cfg.egress_allow.is_empty() {
        tracing::info!(
            entries = cfg.egress_allow.len(),
            "deployment egress allowlist loaded"
        );
    }
    if let Some(root) = &cfg.cache_root {
        tracing::info!(cache_root = %root.display(), max_gb = cfg.cache_max_gb, "warm repo cache configured; not available in this build");
    }
    let images = Arc::new(crate::imagesvc::Images::new(&cfg, &state_dir)?);
    let key = host.cgroup_parent.trim_start_matches("/sbx-").to_string();
    let net = match crate::network::Network::new(
        &key,
        state_dir.join("netns"),
        cfg.subnet,
        cfg.proxy_ports,
        cfg.egress_allow.clone(),
    ) {
        Ok(n) => Ok(Arc::new(n)),
        Err(e) => {
            let why = format!("{:#}", anyhow::Error::from(e));
            tracing::error!(error = %why, "network tiers unavailable; only network none works");
            Err(why)
        }
    };
    let runs = Runs::start(host.clone(), cfg.server_name.clone(), images.clone(), net)?;
    match images.gc().await {
        Ok(gone) if !gone.is_empty() => {
            tracing::info!(layers = gone.len(), "removed unreferenced layers")
        }
        Ok(_) => {}
        Err(e) => tracing::warn!(error = %e, "layer garbage collection"),
    }
    let reaper = crate::reaper::spawn(runs.clone(), cfg.reaper_tick_secs);
    let state = Arc::new(AppState {
        runs: runs.clone(),
        images,
        host,
        server: cfg.server_name.clone(),
        token,
        max_file_bytes: cfg.max_file_bytes,
        templates: cfg.templates.clone(),
        shutting_down: AtomicBool::new(false),
    });
    let listener = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .with_context(|| format!("bind {}", cfg.listen))?;
    if !cfg.listen.ip().is_loopback() {
        tracing::warn!(listen = %cfg.listen, "the API listens on a non-loopback address");
    }
    tracing::info!(listen = %cfg.listen, state_dir = %state_dir.display(), server = %cfg.server_name, "sbx serving");
    let st = state.clone();
    let shutdown = async move {
        let mut term =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {},
            _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending().await } } => {},
        }
        st.shutting_down.store(true, Ordering::Relaxed);
        tracing::info!("shutting down");
    };
    // Small SSE frames must not wait for delayed ACKs (Nagle): ~40 ms each.
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(error = %e, "TCP_NODELAY");
        }
    });
    let server = axum::serve(listener, api::router(state.clone())).with_graceful_shutdown(shutdown);
    let served = server.await;
    reaper.abort();
    let stop = cfg.stop_runs_on_exit;
    if tokio::time::timeout(Duration::from_secs(30), runs.shutdown(stop))
        .await
        .is_err()
    {
        tracing::error!("shutdown did not finish within 30 s");
    }
    if stop {
        // Every run is gone: the daemon's cgroup parent goes too.
        sbx_runtime::cgroups::remove_if_empty(&state.host.layout, &state.host.cgroup_parent);
    }
    served.context("http server")?;
    tracing::info!(stopped_runs = stop, "stopped");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cgroup_parent_differs_per_state_dir() {
        let a = cgroup_parent(Path::new("/var/lib/sbx"));
        let b = cgroup_parent(Path::new("/tmp/sbx-test-1"));
        assert_ne!(a, b);
        assert_eq!(a.len(), "/sbx-".len() + 8);
    }

    #[test]
    fn token_is_minted_once_with_mode_0600() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().expect("tmp");
        let p = d.path().join("token");
        let t1 = load_or_mint_token(&p).expect("mint");
        assert_eq!(t1.len(), 64);
        assert_eq!(
            std::fs::metadata(&p).expect("meta").permissions().mode() & 0o777,
            0o600
        );
        assert_eq!(load_or_mint_token(&p).expect("again"), t1);
    }
}
