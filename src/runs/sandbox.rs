//! The kernel side of one run, driven from the daemon: lay out the root,
//! write the bundle, spawn the shim and wait for it; and tear everything
//! down again (shim, processes, cgroups, mounts, files) — including after a
//! crash, from whatever is left on disk.

use std::os::fd::OwnedFd;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use tokio::io::{AsyncBufReadExt, AsyncReadExt};

use sbx_images::host::{self, RunUser};
use sbx_runtime::{cgroups, spec, BindMount, Layout, RunPaths, RunSpec, ShimState};

use super::model::CreatePlan;

#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error("prepare root filesystem in {path}")]
    Rootfs {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("write bundle")]
    Bundle(#[source] std::io::Error),
    #[error("the image's root cannot be used: {0}")]
    Image(String),
    #[error("spawn shim")]
    Spawn(#[source] std::io::Error),
    #[error("shim failed: {0}")]
    Shim(String),
    #[error("mount image")]
    Mount(#[source] sbx_images::overlay::OverlayError),
    #[error("remove cgroups")]
    Cgroups(#[source] cgroups::CgroupError),
    #[error("mounts remain under {0}")]
    MountsRemain(PathBuf),
    #[error("remove {path}")]
    Remove {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Host facts every run needs, fixed at start.
#[derive(Debug, Clone)]
pub struct Host {
    pub state_dir: PathBuf,
    pub layout: Layout,
    pub self_exe: PathBuf,
    /// The static init every run gets as PID 1 (read-only bind).
    pub init_binary: PathBuf,
    /// The seccomp profile compiled once to BPF: installed by every run's
    /// init (from the spec) and every exec (from the file).
    pub seccomp: Option<Seccomp>,
    /// cgroup parent of this daemon's runs, e.g. `/sbx-1a2b3c4d`.
    pub cgroup_parent: String,
    /// The zygote shims are forked from.
    pub zygote: std::sync::Arc<ShimZygote>,
    /// Run directories made ahead of the creates that take them.
    pub spares: std::sync::Arc<SpareDirs>,
}

/// Run directories made ahead, in the runs directory, as
/// `.spare-<pid>-<n>`: a create renames one to its run's name (~20 us)
/// instead of making it. The runs directory spreads its subdirectories
/// over ext4's block groups (see `spread_subdirectories`), which made a
/// run directory's `mkdir` cost ~230 us here, first on the create's path.
/// Spares left by a daemon that stopped are removed by the next one's
/// reconciliation.
#[derive(Debug)]
pub struct SpareDirs {
    runs_dir: PathBuf,
    ready: std::sync::Mutex<Vec<PathBuf>>,
    made: std::sync::atomic::AtomicU64,
    filling: std::sync::atomic::AtomicBool,
    /// Set at shutdown: spares are removed and no more are made.
    closed: std::sync::atomic::AtomicBool,
}

/// Spare run directories are named `<SPARE_PREFIX><pid>-<n>`.
pub const SPARE_PREFIX: &str = ".spare-";

/// How many spares are kept.
const SPARE_DIRS: usize = 2;

impl SpareDirs {
    pub fn new(runs_dir: PathBuf) -> SpareDirs {
        SpareDirs {
            runs_dir,
            ready: std::sync::Mutex::new(Vec::new()),
            made: std::sync::atomic::AtomicU64::new(0),
            filling: std::sync::atomic::AtomicBool::new(false),
            closed: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Removes the spares and makes no more (shutdown).
    pub fn close(&self) {
        self.closed
            .store(true, std::sync::atomic::Ordering::Release);
        for s in self.ready().drain(..) {
            let _ = std::fs::remove_dir(s);
        }
    }

    fn ready(&self) -> std::sync::MutexGuard<'_, Vec<PathBuf>> {
        self.ready.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Makes `dir` (a run directory) from a spare if one is ready, else
    /// anew; then tops the spares up (see [`crate::pools::top_up_soon`]).
    pub fn make(self: &std::sync::Arc<Self>, dir: &Path) -> std::io::Result<()> {
        let spare = self.ready().pop();
        let made = match spare {
            Some(s) => std::fs::rename(&s, dir).or_else(|_| {
                let _ = std::fs::remove_dir(&s);
                std::fs::create_dir_all(dir)
            }),
            None => std::fs::create_dir_all(dir),
        };
        let me = self.clone();
        crate::pools::top_up_soon(!self.ready().is_empty(), move || me.fill());
        made
    }

    /// Fills the spares up, on a blocking thread. Needs a tokio runtime.
    pub fn fill(self: &std::sync::Arc<Self>) {
        use std::sync::atomic::Ordering;
        if self.closed.load(Ordering::Acquire) || self.filling.swap(true, Ordering::AcqRel) {
            return;
        }
        let me = self.clone();
        tokio::spawn(async move {
            let filler = me.clone();
            let _ = tokio::task::spawn_blocking(move || {
                while filler.ready().len() < SPARE_DIRS {
                    let n = filler.made.fetch_add(1, Ordering::Relaxed);
                    let path = filler
                        .runs_dir
                        .join(format!("{SPARE_PREFIX}{}-{n}", std::process::id()));
                    if let Err(e) = std::fs::create_dir(&path) {
                        tracing::warn!(path = %path.display(), error = %e, "make a spare run directory");
                        break;
                    }
                    if filler.closed.load(Ordering::Acquire) {
                        let _ = std::fs::remove_dir(&path);
                        break;
                    }
                    filler.ready().push(path);
                }
            })
            .await;
            me.filling.store(false, Ordering::Release);
        });
    }
}

/// The precompiled seccomp program, and the file the shims read it from.
#[derive(Debug, Clone)]
pub struct Seccomp {
    pub path: PathBuf,
    pub program: std::sync::Arc<Vec<u8>>,
}

/// The daemon's shim zygote (`sbx shim --zygote`, see there): every shim
/// is forked from it. Restarted on demand if it died.
#[derive(Debug)]
pub struct ShimZygote {
    self_exe: PathBuf,
    /// Set as `SBX_SHIM_OF` in the zygote's environment (and so its
    /// shims'): which daemon it belongs to (tests check it does not outlive
    /// its daemon).
    state_dir: PathBuf,
    zygote: tokio::sync::Mutex<Option<(tokio::process::Child, OwnedFd)>>,
}

impl ShimZygote {
    pub fn new(self_exe: PathBuf, state_dir: PathBuf) -> ShimZygote {
        ShimZygote {
            self_exe,
            state_dir,
            zygote: tokio::sync::Mutex::new(None),
        }
    }

    fn spawn(&self) -> std::io::Result<(tokio::process::Child, OwnedFd)> {
        use nix::sys::socket::{socketpair, AddressFamily, SockFlag, SockType};
        let (ours, theirs) = socketpair(
            AddressFamily::Unix,
            SockType::SeqPacket,
            None,
            SockFlag::SOCK_CLOEXEC,
        )
        .map_err(std::io::Error::from)?;
        let child = tokio::process::Command::new(&self.self_exe)
            .arg("shim")
            .arg("--zygote")
            .env_clear()
            .env("RUST_LOG", "error")
            .env("SBX_SHIM_OF", &self.state_dir)
            .stdin(std::process::Stdio::from(theirs))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()?;
        Ok((child, ours))
    }

    /// Starts the zygote now rather than at the first create.
    pub async fn start(&self) {
        let mut z = self.zygote.lock().await;
        if z.is_none() {
            match self.spawn() {
                Ok(s) => *z = Some(s),
                Err(e) => tracing::warn!(error = %e, "start the shim zygote"),
            }
        }
    }

    /// Has the zygote fork a shim for the run in `dir`; returns the pipe the
    /// shim answers `ready <state>` or `error <why>` on. The shim sets
    /// itself up, then waits for a byte on `go` before it reads the bundle
    /// and creates the run, so the daemon can lay out the root and bundle
    /// meanwhile (a closed `go` gives up).
    pub async fn fork_shim(
        &self,
        dir: &Path,
        id: &str,
        go: OwnedFd,
    ) -> std::io::Result<tokio::net::unix::pipe::Receiver> {
        use std::os::fd::AsFd;
        let (r, w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
        let line = format!("{}\t{id}\n", dir.display());
        let mut z = self.zygote.lock().await;
        let mut last = None;
        for _ in 0..2 {
            let alive = match z.as_mut() {
                Some((c, _)) => matches!(c.try_wait(), Ok(None)),
                None => false,
            };
            if !alive {
                *z = Some(self.spawn()?);
            }
            let Some((_, sock)) = z.as_ref() else {
                continue;
            };
            let sent = sbx_runtime::fdpass::send_with_fds(
                sock.as_fd(),
                line.as_bytes(),
                &[w.as_fd(), go.as_fd()],
            );
            match sent {
                Ok(_) => {
                    drop(w);
                    return tokio::net::unix::pipe::Receiver::from_owned_fd(r);
                }
                Err(e) => {
                    // The zygote is gone: start another and try once more.
                    last = Some(e);
                    *z = None;
                }
            }
        }
        Err(last.unwrap_or_else(|| std::io::Error::other("no shim zygote")))
    }
}

/// Where a state directory keeps its runs' directories.
pub fn runs_dir(state_dir: &Path) -> PathBuf {
    state_dir.join("runs")
}

impl Host {
    pub fn runs_dir(&self) -> PathBuf {
        runs_dir(&self.state_dir)
    }
    pub fn paths(&self, id: &str) -> RunPaths {
        RunPaths::new(self.runs_dir().join(id))
    }
    pub fn cgroup(&self, id: &str) -> String {
        format!("{}/{id}", self.cgroup_parent)
    }
    /// The layer laid over every image (see [`install_skeleton`]).
    pub fn skeleton(&self) -> PathBuf {
        self.state_dir.join(SKELETON_DIR)
    }
}

const SKELETON_DIR: &str = "skeleton";

/// The mount points every image root needs, with their modes.
const MOUNT_POINTS: [(&str, u32); 5] = [
    ("proc", 0o555),
    ("dev", 0o755),
    ("sys", 0o555),
    ("tmp", 0o1777),
    (".sbx", 0o755),
];

/// Makes (or repairs) `<state>/skeleton`: the mount points every run's
/// root needs, as the topmost, read-only layer of every image root — as
/// Docker's init layer does — so a create makes none of them. A directory
/// here hides a file or symlink an image has at that path. Left in place
/// across restarts: live runs' roots are mounted over it.
pub fn install_skeleton(state_dir: &Path) -> std::io::Result<PathBuf> {
    let dir = state_dir.join(SKELETON_DIR);
    for (name, mode) in MOUNT_POINTS {
        let d = dir.join(name);
        std::fs::create_dir_all(&d)?;
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(mode))?;
    }
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755))?;
    Ok(dir)
}

/// The root of a run: the `host` image, or an overlay of image layers.
#[derive(Debug, Clone)]
pub enum Root {
    Host,
    /// Layer directories, topmost first, and the image's environment.
    Layers {
        layers: Vec<PathBuf>,
        env: Vec<(String, String)>,
    },
}

/// `/work` (and the workdir) owned by the run's user, made without
/// following any symlink an image may have put on the way.
fn chown_work(
    rootfs: &Path,
    workdir: &str,
    uid: u32,
    gid: u32,
) -> Result<(), super::files::FileError> {
    for dir in ["/work", workdir] {
        super::files::ensure_dir(rootfs, dir, 0o755, Some((uid, gid)))?;
    }
    Ok(())
}

fn image_err(e: super::files::FileError) -> SandboxError {
    SandboxError::Image(e.to_string())
}

/// Lays out the run's root (blocking): the `host` root's directories, or
/// an image's upper directory and overlay; then `/work` and the workdir
/// owned by the run's user and `/etc/resolv.conf` where the layout did not
/// already put them. Returns the read-only binds the `host` root needs.
fn layout_root(
    host: &Host,
    id: &str,
    plan: &CreatePlan,
    root: &Root,
) -> Result<Vec<BindMount>, SandboxError> {
    let paths = host.paths(id);
    let rootfs = paths.rootfs();
    let err = |source| SandboxError::Rootfs {
        path: rootfs.clone(),
        source,
    };
    std::fs::create_dir_all(&rootfs).map_err(err)?;
    std::fs::set_permissions(&paths.dir, std::fs::Permissions::from_mode(0o711)).map_err(err)?;
    let user = RunUser {
        uid: plan.uid,
        gid: plan.gid,
    };
    let mut ro_binds = Vec::new();
    match root {
        Root::Host => {
            for b in host::prepare(&rootfs, Path::new("/"), id, user).map_err(err)? {
                ro_binds.push(BindMount {
                    source: b.source,
                    destination: b.destination,
                });
            }
            // Through the confined walk: no symlink is followed out of it.
            chown_work(&rootfs, &plan.workdir, plan.uid, plan.gid).map_err(image_err)?;
            let resolv = crate::network::Network::resolv_conf(super::model::tier_of(&plan.network));
            super::files::write_root_file(&rootfs, "etc/resolv.conf", resolv.as_bytes(), 0o644)
                .map_err(image_err)?;
        }
        Root::Layers { layers, .. } => {
            // Recorded first, so garbage collection never takes a layer in use.
            let names = serde_json::to_vec(layers).map_err(|e| err(e.into()))?;
            sbx_runtime::write_atomic(&paths.dir.join(crate::imagesvc::RUN_LAYERS_FILE), &names)
                .map_err(err)?;
            std::fs::create_dir_all(paths.overlay_work()).map_err(err)?;
            seed_upper(&paths.upper(), id, plan).map_err(err)?;
            let mut lowers = Vec::with_capacity(layers.len() + 1);
            lowers.push(host.skeleton());
            lowers.extend(layers.iter().cloned());
            let api =
                sbx_images::overlay::mount(&lowers, &paths.upper(), &paths.overlay_work(), &rootfs)
                    .map_err(SandboxError::Mount)?;
            tracing::debug!(run = id, layers = layers.len(), ?api, "overlay mounted");
            // `/work` is in the upper directory already; another workdir is
            // made through the confined walk (no symlink of the image's is
            // followed out of the root).
            if super::files::components(&plan.workdir).map_err(image_err)? != ["work"] {
                super::files::ensure_dir(&rootfs, &plan.workdir, 0o755, Some((plan.uid, plan.gid)))
                    .map_err(image_err)?;
            }
        }
    }
    Ok(ro_binds)
}

/// The run's OCI spec, from what is known before anything is on disk
/// (and, for `host`, the binds [`layout_root`] returned).
fn run_spec(
    host: &Host,
    id: &str,
    plan: &CreatePlan,
    ro_binds: Vec<BindMount>,
    netns: Option<PathBuf>,
) -> RunSpec {
    let mut env = vec!["HOME=/work".to_string(), format!("HOSTNAME={id}")];
    env.push(format!("PATH={}", spec::DEFAULT_PATH));
    RunSpec {
        id: id.to_string(),
        rootfs: host.paths(id).rootfs(),
        init_binary: host.init_binary.clone(),
        uid: plan.uid,
        gid: plan.gid,
        env,
        limits: plan.limits,
        cgroups_path: host.cgroup(id),
        ro_binds,
        swap_accounting: host.layout.swap_accounting(),
        nofile: spec::nofile_limit(),
        // The init installs it (see RunSpec).
        seccomp_bpf: host.seccomp.as_ref().map(|s| s.program.to_vec()),
        netns,
    }
}

/// What an image root gets in its (still empty) upper directory before
/// the overlay is mounted: `/etc/hostname`, `/etc/resolv.conf` and `/work`
/// owned by the run's user. Written there, they are plain files of a fresh
/// directory of ours — no path of the image's is walked, nothing is copied
/// up — and they lie over whatever the image has at those paths.
fn seed_upper(upper: &Path, id: &str, plan: &CreatePlan) -> std::io::Result<()> {
    let etc = upper.join("etc");
    std::fs::create_dir_all(&etc)?;
    let resolv = crate::network::Network::resolv_conf(super::model::tier_of(&plan.network));
    for (name, body) in [("hostname", format!("{id}\n")), ("resolv.conf", resolv)] {
        std::fs::write(etc.join(name), body)?;
        std::fs::set_permissions(etc.join(name), std::fs::Permissions::from_mode(0o644))?;
    }
    let work = upper.join("work");
    std::fs::create_dir(&work)?;
    std::fs::set_permissions(&work, std::fs::Permissions::from_mode(0o755))?;
    std::os::unix::fs::chown(&work, Some(plan.uid), Some(plan.gid))
}

/// A shim that reported ready (a child of the zygote, not of the daemon).
pub struct Started {
    pub shim: ShimState,
    /// The image's environment (empty for `host`).
    pub image_env: Vec<(String, String)>,
    /// The run's egress proxy (allowlist tier), set once networking is up.
    pub proxy: Option<tokio::task::JoinHandle<()>>,
    /// The network the run took from the pool (networked tiers).
    pub net: Option<crate::network::RunNet>,
}

/// Creates the run: root, bundle, shim. `netns` is a prepared network
/// namespace to join (networked tiers). On error everything is torn down.
pub async fn create(
    host: &Host,
    id: &str,
    plan: &CreatePlan,
    root: Root,
    netns: Option<PathBuf>,
) -> Result<Started, SandboxError> {
    let result = create_inner(host, id, plan, root, netns).await;
    if result.is_err() {
        let (h, i) = (host.clone(), id.to_string());
        let _ = tokio::task::spawn_blocking(move || destroy(&h, &i)).await;
    }
    result
}

async fn create_inner(
    host: &Host,
    id: &str,
    plan: &CreatePlan,
    root: Root,
    netns: Option<PathBuf>,
) -> Result<Started, SandboxError> {
    let image_env = match &root {
        Root::Host => Vec::new(),
        Root::Layers { env, .. } => env.clone(),
    };
    let paths = host.paths(id);
    let t0 = std::time::Instant::now();
    // The run directory first: the shim is forked into it (its cwd names
    // the run) and sets itself up while the root and bundle are laid out;
    // it creates the run once told `go`.
    host.spares
        .make(&paths.dir)
        .map_err(|source| SandboxError::Rootfs {
            path: paths.dir.clone(),
            source,
        })?;
    let (go_r, go_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
        .map_err(|e| SandboxError::Spawn(e.into()))?;
    let stdout = host
        .zygote
        .fork_shim(&paths.dir, id, go_r)
        .await
        .map_err(SandboxError::Spawn)?;
    let t_forked = t0.elapsed();
    let laid = lay_out(host, id, plan, root, netns).await;
    if let Err(e) = laid {
        // The shim leaves on the closed `go`, and its end of the ready pipe
        // closes with it (or with the zygote's copy, if it never forked
        // it). Wait for that: the teardown after this must not race a shim
        // of this run still to come (it would make files in the run
        // directory while it is removed).
        drop(go_w);
        let mut rest = Vec::new();
        let mut stdout = stdout;
        let _ = tokio::time::timeout(Duration::from_secs(5), stdout.read_to_end(&mut rest)).await;
        return Err(e);
    }
    let t_root = t0.elapsed();
    nix::unistd::write(&go_w, b"g").map_err(|e| SandboxError::Spawn(e.into()))?;
    drop(go_w);
    let mut line = String::new();
    let mut reader = tokio::io::BufReader::new(stdout);
    let read = reader.read_line(&mut line);
    let ok = tokio::time::timeout(Duration::from_secs(30), read).await;
    if !matches!(ok, Ok(Ok(n)) if n > 0) || !line.starts_with("ready ") {
        // A shim still at work is found by its cwd and killed by destroy().
        let msg = line
            .strip_prefix("error ")
            .unwrap_or("shim exited without a word")
            .trim();
        let log = std::fs::read_to_string(paths.shim_log()).unwrap_or_default();
        let last: Vec<&str> = log.lines().rev().take(3).collect();
        tracing::warn!(run = id, shim_log = %last.join(" | "), "shim failed");
        return Err(SandboxError::Shim(msg.to_string()));
    }
    let shim = ready_state(&line)
        .ok_or_else(|| SandboxError::Shim(format!("malformed answer {:?}", line.trim_end())))?;
    tracing::debug!(
        run = id,
        forked_us = t_forked.as_micros() as u64,
        root_us = t_root.as_micros() as u64,
        shim_ready_us = t0.elapsed().as_micros() as u64,
        "sandbox created"
    );
    Ok(Started {
        shim,
        image_env,
        proxy: None,
        net: None,
    })
}

/// Lays out the run's root and writes its bundle: for an image root both
/// at once (its spec needs nothing from the layout), for `host` one after
/// the other (its binds come from the layout).
async fn lay_out(
    host: &Host,
    id: &str,
    plan: &CreatePlan,
    root: Root,
    netns: Option<PathBuf>,
) -> Result<(), SandboxError> {
    let (h, i, p) = (host.clone(), id.to_string(), plan.clone());
    let joined = |e: tokio::task::JoinError| SandboxError::Shim(e.to_string());
    if matches!(root, Root::Layers { .. }) {
        let spec = run_spec(host, id, plan, Vec::new(), netns);
        let bundle = host.paths(id).bundle();
        let bundle = tokio::task::spawn_blocking(move || spec::write_bundle(&bundle, &spec));
        let root = tokio::task::spawn_blocking(move || layout_root(&h, &i, &p, &root));
        let (bundle, root) = tokio::join!(bundle, root);
        root.map_err(joined)??;
        bundle.map_err(joined)?.map_err(SandboxError::Bundle)?;
    } else {
        tokio::task::spawn_blocking(move || {
            let binds = layout_root(&h, &i, &p, &root)?;
            let spec = run_spec(&h, &i, &p, binds, netns);
            spec::write_bundle(&h.paths(&i).bundle(), &spec).map_err(SandboxError::Bundle)
        })
        .await
        .map_err(joined)??;
    }
    Ok(())
}

/// The shim's state from its `ready <state>` line.
fn ready_state(line: &str) -> Option<ShimState> {
    serde_json::from_str(line.trim_end().strip_prefix("ready ")?).ok()
}

/// Tears a run down completely; blocking. Safe to call on anything left
/// behind, any number of times.
pub fn destroy(host: &Host, id: &str) -> Result<(), SandboxError> {
    let paths = host.paths(id);
    let t0 = Instant::now();
    // Time the run's processes get to leave on their own before their
    // cgroups are frozen and killed from outside.
    let mut grace = Duration::ZERO;
    if let Ok(state) = ShimState::load(&paths) {
        if stop_shim(&state) {
            grace = Duration::from_millis(100);
        }
    } else {
        for pid in find_shims(&host.runs_dir())
            .into_iter()
            .filter(|(_, i)| i == id)
        {
            let _ = kill(Pid::from_raw(pid.0), Signal::SIGKILL);
        }
    }
    let t_shim = t0.elapsed();
    let shim_state = ShimState::load(&paths).ok();
    cgroups::destroy_tree(
        &host.layout,
        &host.cgroup(id),
        grace,
        Duration::from_secs(5),
    )
    .map_err(SandboxError::Cgroups)?;
    let t_cgroups = t0.elapsed();
    // The init is gone; the shim records its exit in the run directory and
    // leaves. Let it finish before the directory goes.
    if let Some(st) = shim_state {
        let deadline = Instant::now() + Duration::from_secs(2);
        while st.shim_alive() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_micros(200));
        }
        if st.shim_alive() {
            let _ = kill(Pid::from_raw(st.shim_pid), Signal::SIGKILL);
        }
    }
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let mut mounts = sbx_images::overlay::mounts_under(&mountinfo, &paths.dir);
    mounts.sort_by_key(|m| std::cmp::Reverse(m.components().count()));
    for m in mounts {
        sbx_images::overlay::unmount(&m).map_err(SandboxError::Mount)?;
    }
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    if !sbx_images::overlay::mounts_under(&mountinfo, &paths.dir).is_empty() {
        return Err(SandboxError::MountsRemain(paths.dir));
    }
    let t_mounts = t0.elapsed();
    let removed = std::fs::remove_dir_all(&paths.dir);
    tracing::debug!(
        run = id,
        shim_us = t_shim.as_micros() as u64,
        cgroups_us = t_cgroups.as_micros() as u64,
        mounts_us = t_mounts.as_micros() as u64,
        total_us = t0.elapsed().as_micros() as u64,
        "sandbox destroyed"
    );
    match removed {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(SandboxError::Remove {
            path: paths.dir,
            source,
        }),
    }
}

/// Kills the run's init (its pid namespace goes with it) and tells the shim
/// to exit; the cgroup removal that follows waits for the processes to go.
/// Returns whether the init was killed here.
fn stop_shim(state: &ShimState) -> bool {
    let killed = state.init_alive() && kill(Pid::from_raw(state.init_pid), Signal::SIGKILL).is_ok();
    if state.shim_alive() {
        let _ = kill(Pid::from_raw(state.shim_pid), Signal::SIGTERM);
    }
    killed
}

/// `(pid, run id)` of every shim process serving a run under `runs_dir`.
pub fn find_shims(runs_dir: &Path) -> Vec<(i32, String)> {
    let mut found: Vec<(i32, i32, String)> = Vec::new();
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    for e in rd.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(cmd) = std::fs::read(e.path().join("cmdline")) else {
            continue;
        };
        let args: Vec<&[u8]> = cmd.split(|b| *b == 0).collect();
        if args.len() >= 3 && args[1] == b"shim" && args[2] == b"--zygote" {
            // A forked shim names its run by its working directory (the
            // zygote's own is elsewhere).
            let Ok(dir) = std::fs::read_link(e.path().join("cwd")) else {
                continue;
            };
            if dir.parent() == Some(runs_dir) {
                if let Some(id) = dir.file_name() {
                    let ppid = std::fs::read_to_string(e.path().join("stat"))
                        .ok()
                        .and_then(|s| {
                            let rest = s.rsplit_once(") ")?.1.to_string();
                            rest.split(' ').nth(1)?.parse::<i32>().ok()
                        })
                        .unwrap_or(0);
                    found.push((pid, ppid, id.to_string_lossy().into_owned()));
                }
            }
        }
    }
    // A shim's exec standby looks like its shim for the moment after its
    // fork; its parent is that shim.
    let pids: Vec<i32> = found.iter().map(|(p, _, _)| *p).collect();
    found
        .into_iter()
        .filter(|(_, ppid, _)| !pids.contains(ppid))
        .map(|(pid, _, id)| (pid, id))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ready_line_carries_the_shim_state() {
        let s = ready_state(
            "ready {\"shim_pid\":7,\"shim_start\":8,\"init_pid\":42,\"init_start\":9}\n",
        )
        .expect("state");
        assert_eq!(
            (s.shim_pid, s.shim_start, s.init_pid, s.init_start),
            (7, 8, 42, 9)
        );
        // Anything else is no state: the create fails, naming the line.
        assert!(ready_state("ready 42\n").is_none());
        assert!(ready_state("error nope\n").is_none());
    }

    fn spares_in(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .expect("read")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(SPARE_PREFIX))
            .collect();
        v.sort();
        v
    }

    async fn until(what: &str, f: impl Fn() -> bool) {
        for _ in 0..400 {
            if f() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        panic!("gave up waiting for {what}");
    }

    #[tokio::test]
    async fn a_run_directory_is_a_renamed_spare_and_spares_go_at_close() {
        let d = tempfile::tempdir().expect("tmp");
        let spares = std::sync::Arc::new(SpareDirs::new(d.path().to_path_buf()));
        // Without a spare the directory is made; spares are made after.
        spares.make(&d.path().join("run0")).expect("make");
        assert!(d.path().join("run0").is_dir());
        until("two spares", || spares_in(d.path()).len() == SPARE_DIRS).await;
        let before = spares_in(d.path());
        spares.make(&d.path().join("run1")).expect("make");
        assert!(d.path().join("run1").is_dir());
        let after = spares_in(d.path());
        assert_eq!(after.len(), SPARE_DIRS - 1, "{after:?}");
        assert!(after.iter().all(|a| before.contains(a)));
        spares.close();
        assert!(spares_in(d.path()).is_empty());
        // Closed: taking makes the directory, and no spare comes back.
        spares.make(&d.path().join("run2")).expect("make");
        assert!(d.path().join("run2").is_dir());
        tokio::time::sleep(crate::pools::TOP_UP_DELAY * 2).await;
        assert!(spares_in(d.path()).is_empty());
    }

    #[test]
    fn the_skeleton_has_every_mount_point_with_its_mode_and_survives_a_reinstall() {
        let d = tempfile::tempdir().expect("tmp");
        let dir = install_skeleton(d.path()).expect("install");
        // A restart finds it there, modes changed meanwhile: it is repaired.
        std::fs::set_permissions(dir.join("tmp"), std::fs::Permissions::from_mode(0o700))
            .expect("chmod");
        assert_eq!(install_skeleton(d.path()).expect("again"), dir);
        let mut names: Vec<String> = std::fs::read_dir(&dir)
            .expect("read")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(names, [".sbx", "dev", "proc", "sys", "tmp"]);
        for (name, mode) in MOUNT_POINTS {
            let m = std::fs::metadata(dir.join(name)).expect("meta");
            assert!(m.is_dir());
            assert_eq!(m.permissions().mode() & 0o7777, mode, "{name}");
        }
    }

    #[test]
    fn the_upper_directory_is_seeded_with_hostname_resolver_and_work() {
        use std::os::unix::fs::MetadataExt;
        let d = tempfile::tempdir().expect("tmp");
        let upper = d.path().join("upper");
        std::fs::create_dir(&upper).expect("upper");
        let plan = CreatePlan {
            image: "x".into(),
            template: None,
            env: Vec::new(),
            ttl_secs: 60,
            network: "none".into(),
            egress_allow: Vec::new(),
            limits: sbx_runtime::Limits {
                cpu_millis: 1000,
                memory_bytes: 1 << 30,
                pids: 256,
            },
            labels: Default::default(),
            // Whoever runs the test: chown to anyone else needs root.
            uid: nix::unistd::getuid().as_raw(),
            gid: nix::unistd::getgid().as_raw(),
            workdir: "/work".into(),
        };
        seed_upper(&upper, "01RUN", &plan).expect("seed");
        let hostname = upper.join("etc/hostname");
        assert_eq!(
            std::fs::read_to_string(&hostname).expect("hostname"),
            "01RUN\n"
        );
        let resolv = std::fs::read_to_string(upper.join("etc/resolv.conf")).expect("resolv");
        assert_eq!(resolv, crate::network::Network::resolv_conf(None));
        for f in [hostname, upper.join("etc/resolv.conf")] {
            assert_eq!(
                std::fs::metadata(&f).expect("meta").permissions().mode() & 0o777,
                0o644
            );
        }
        let work = std::fs::metadata(upper.join("work")).expect("work");
        assert!(work.is_dir());
        assert_eq!(work.permissions().mode() & 0o777, 0o755);
        assert_eq!((work.uid(), work.gid()), (plan.uid, plan.gid));
    }
}
