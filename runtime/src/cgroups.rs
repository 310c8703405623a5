//! cgroup layout detection, per-exec sub-cgroups, killing and removal, for
//! v1 (including hybrid hosts) and v2. Roots are parameters so tests run
//! over fixture directories.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::thread::sleep;
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error("read {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("write {path}")]
    Write {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("create cgroup {path}")]
    Create {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("remove cgroup {path}")]
    Remove {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("no cgroup hierarchy is mounted")]
    NoHierarchy,
    #[error("freezing {path} did not settle")]
    FreezeTimeout { path: PathBuf },
}

/// The host's cgroup layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Layout {
    /// v1 controllers, each hierarchy at its mount point (hybrid hosts too:
    /// the empty cgroup2 mount is ignored).
    V1 { hierarchies: Vec<Hierarchy> },
    /// The unified hierarchy.
    V2 { root: PathBuf },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hierarchy {
    pub mount_point: PathBuf,
    pub controllers: Vec<String>,
}

const V1_CONTROLLERS: &[&str] = &[
    "cpu",
    "cpuacct",
    "cpuset",
    "memory",
    "devices",
    "freezer",
    "net_cls",
    "net_prio",
    "blkio",
    "perf_event",
    "hugetlb",
    "pids",
    "rdma",
    "misc",
];

impl Layout {
    /// Detects the layout from `/proc/self/mountinfo` text. Pure.
    pub fn from_mountinfo(text: &str) -> Result<Layout, CgroupError> {
        let mut v1 = Vec::new();
        let mut v2 = None;
        for line in text.lines() {
            let Some((left, right)) = line.split_once(" - ") else {
                continue;
            };
            let left: Vec<&str> = left.split(' ').collect();
            let right: Vec<&str> = right.split(' ').collect();
            if left.len() < 5 || right.len() < 3 {
                continue;
            }
            let mount_point = PathBuf::from(left[4]);
            match right[0] {
                "cgroup2" => v2 = Some(mount_point),
                "cgroup" => {
                    let controllers: Vec<String> = right[2]
                        .split(',')
                        .filter(|o| V1_CONTROLLERS.contains(o))
                        .map(str::to_string)
                        .collect();
                    if !controllers.is_empty() {
                        v1.push(Hierarchy {
                            mount_point,
                            controllers,
                        });
                    }
                }
                _ => {}
            }
        }
        if !v1.is_empty() {
            Ok(Layout::V1 { hierarchies: v1 })
        } else if let Some(root) = v2 {
            Ok(Layout::V2 { root })
        } else {
            Err(CgroupError::NoHierarchy)
        }
    }

    /// Reads the running host's layout.
    pub fn detect() -> Result<Layout, CgroupError> {
        let path = PathBuf::from("/proc/self/mountinfo");
        let text =
            fs::read_to_string(&path).map_err(|source| CgroupError::Read { path, source })?;
        Layout::from_mountinfo(&text)
    }

    /// The layout this process, or the zygote it was forked from, detected
    /// first (the daemon too keeps the one it found at start): a create's
    /// shim does not read and parse mountinfo again, which grows with
    /// every run's overlay mount.
    pub fn detect_once() -> Result<Layout, CgroupError> {
        static KNOWN: std::sync::OnceLock<Layout> = std::sync::OnceLock::new();
        if let Some(l) = KNOWN.get() {
            return Ok(l.clone());
        }
        let l = Layout::detect()?;
        Ok(KNOWN.get_or_init(|| l).clone())
    }

    pub fn is_v2(&self) -> bool {
        matches!(self, Layout::V2 { .. })
    }

    /// The directories of cgroup `rel` (e.g. `/sbx-ab/01J…`), one per
    /// hierarchy. Joined hierarchies (`cpu,cpuacct`) appear once.
    pub fn dirs(&self, rel: &str) -> Vec<PathBuf> {
        let rel = rel.trim_start_matches('/');
        match self {
            Layout::V2 { root } => vec![root.join(rel)],
            Layout::V1 { hierarchies } => {
                let mut out: Vec<PathBuf> = Vec::new();
                for h in hierarchies {
                    let d = h.mount_point.join(rel);
                    if !out.contains(&d) {
                        out.push(d);
                    }
                }
                out
            }
        }
    }

    /// Whether v1 memory accounts swap (`memory.memsw.limit_in_bytes`).
    pub fn swap_accounting(&self) -> bool {
        match self {
            Layout::V2 { root } => root.join("memory.swap.max").exists() || !root.exists(),
            Layout::V1 { hierarchies } => hierarchies
                .iter()
                .find(|h| h.controllers.iter().any(|c| c == "memory"))
                .is_some_and(|h| h.mount_point.join("memory.memsw.limit_in_bytes").exists()),
        }
    }

    fn freezer_dir(&self, rel: &str) -> Option<PathBuf> {
        match self {
            Layout::V2 { root } => Some(root.join(rel.trim_start_matches('/'))),
            Layout::V1 { hierarchies } => hierarchies
                .iter()
                .find(|h| h.controllers.iter().any(|c| c == "freezer"))
                .map(|h| h.mount_point.join(rel.trim_start_matches('/'))),
        }
    }
}

/// Creates cgroup `rel` in every hierarchy (no controllers are enabled for
/// it on v2: its processes stay charged to the nearest limited ancestor).
pub fn create(layout: &Layout, rel: &str) -> Result<Vec<PathBuf>, CgroupError> {
    let dirs = layout.dirs(rel);
    for d in &dirs {
        make_dir(d, true)?;
    }
    Ok(dirs)
}

/// Makes one cgroup directory (there already is fine); a new one gets its
/// parent's cpuset where `cpuset` says the hierarchy may have one.
fn make_dir(dir: &Path, cpuset: bool) -> Result<(), CgroupError> {
    match fs::create_dir(dir) {
        Ok(()) if cpuset => inherit_cpuset(dir),
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(()),
        Err(source) => Err(CgroupError::Create {
            path: dir.to_path_buf(),
            source,
        }),
    }
}

/// A new v1 cpuset cgroup starts with no CPUs and no memory nodes, and
/// nothing can join it; give it its parent's.
fn inherit_cpuset(dir: &Path) -> Result<(), CgroupError> {
    for file in ["cpuset.cpus", "cpuset.mems"] {
        let path = dir.join(file);
        let current = match fs::read_to_string(&path) {
            Ok(c) => c,
            Err(_) => continue,
        };
        if !current.trim().is_empty() {
            continue;
        }
        let Some(parent) = dir.parent() else { continue };
        let ppath = parent.join(file);
        let value = fs::read_to_string(&ppath).map_err(|source| CgroupError::Read {
            path: ppath,
            source,
        })?;
        fs::write(&path, value.trim()).map_err(|source| CgroupError::Write { path, source })?;
    }
    Ok(())
}

/// Whether an exec gets its own cgroup in this v1 hierarchy: only where it
/// is needed to kill the exec's processes from outside.
fn exec_owns(h: &Hierarchy) -> bool {
    h.controllers.iter().any(|c| c == "freezer" || c == "pids")
}

/// Moves `pid` into the exec cgroup `exec_rel` (a child of the run's).
/// It is created where it is needed to kill the exec's processes — the v2
/// tree, or the v1 freezer and pids hierarchies; in every other v1 hierarchy
/// the exec joins the run's own cgroup, which saves a mkdir per hierarchy
/// and keeps it under the run's limits all the same.
pub fn join_exec(layout: &Layout, exec_rel: &str, pid: u32) -> Result<(), CgroupError> {
    let run_rel = exec_rel
        .rsplit_once('/')
        .map(|(p, _)| p)
        .unwrap_or(exec_rel);
    join_run_shared(layout, run_rel, pid)?;
    join_exec_own(layout, exec_rel, pid)
}

/// The part of [`join_exec`] that does not depend on the exec: the run's
/// own cgroup in every v1 hierarchy where an exec gets none (nothing on v2).
pub fn join_run_shared(layout: &Layout, run_rel: &str, pid: u32) -> Result<(), CgroupError> {
    let Layout::V1 { hierarchies } = layout else {
        return Ok(());
    };
    let mut done: Vec<&Path> = Vec::new();
    for h in hierarchies.iter().filter(|h| !exec_owns(h)) {
        if done.contains(&h.mount_point.as_path()) {
            continue;
        }
        done.push(&h.mount_point);
        write_procs(&h.mount_point.join(run_rel.trim_start_matches('/')), pid)?;
    }
    Ok(())
}

/// The other part of [`join_exec`]: creates the exec's own cgroup where it
/// gets one and moves `pid` there.
pub fn join_exec_own(layout: &Layout, exec_rel: &str, pid: u32) -> Result<(), CgroupError> {
    for d in exec_own_dirs(layout, exec_rel)? {
        write_procs(&d, pid)?;
    }
    Ok(())
}

/// Creates the exec's own cgroup where it gets one and opens each
/// `cgroup.procs` for writing: a process that writes "0" to them joins
/// (an exec standby's command does, before it execs).
pub fn open_exec_own(layout: &Layout, exec_rel: &str) -> Result<Vec<fs::File>, CgroupError> {
    exec_own_dirs(layout, exec_rel)?
        .into_iter()
        .map(|d| {
            let path = d.join("cgroup.procs");
            fs::OpenOptions::new()
                .write(true)
                .open(&path)
                .map_err(|source| CgroupError::Write { path, source })
        })
        .collect()
}

fn exec_own_dirs(layout: &Layout, exec_rel: &str) -> Result<Vec<PathBuf>, CgroupError> {
    let targets: Vec<PathBuf> = match layout {
        Layout::V2 { .. } => create(layout, exec_rel)?,
        Layout::V1 { hierarchies } => {
            let mut out: Vec<PathBuf> = Vec::new();
            for h in hierarchies.iter().filter(|h| exec_owns(h)) {
                let d = h.mount_point.join(exec_rel.trim_start_matches('/'));
                if out.contains(&d) {
                    continue;
                }
                make_dir(&d, h.controllers.iter().any(|c| c == "cpuset"))?;
                out.push(d);
            }
            out
        }
    };
    Ok(targets)
}

fn write_procs(dir: &Path, pid: u32) -> Result<(), CgroupError> {
    let path = dir.join("cgroup.procs");
    fs::write(&path, pid.to_string()).map_err(|source| CgroupError::Write { path, source })
}

/// Every pid in the subtree of `dir`.
pub fn pids_in_tree(dir: &Path) -> Vec<i32> {
    let mut out = Vec::new();
    if let Ok(text) = fs::read_to_string(dir.join("cgroup.procs")) {
        out.extend(text.lines().filter_map(|l| l.trim().parse::<i32>().ok()));
    }
    if let Ok(rd) = fs::read_dir(dir) {
        for e in rd.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                out.extend(pids_in_tree(&e.path()));
            }
        }
    }
    out
}

fn set_frozen(layout: &Layout, dir: &Path, frozen: bool) -> Result<(), CgroupError> {
    let (file, value) = if layout.is_v2() {
        ("cgroup.freeze", if frozen { "1" } else { "0" })
    } else {
        ("freezer.state", if frozen { "FROZEN" } else { "THAWED" })
    };
    let path = dir.join(file);
    fs::write(&path, value).map_err(|source| CgroupError::Write {
        path: path.clone(),
        source,
    })?;
    if !frozen || layout.is_v2() {
        return Ok(());
    }
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        let state = fs::read_to_string(&path).unwrap_or_default();
        if state.trim() == "FROZEN" {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(CgroupError::FreezeTimeout { path });
        }
        fs::write(&path, value).map_err(|source| CgroupError::Write {
            path: path.clone(),
            source,
        })?;
        sleep(Duration::from_millis(1));
    }
}

/// Kills every process in cgroup `rel` and its descendants, from outside:
/// nothing inside the run is needed (no fork, no shell). On v2 with
/// `cgroup.kill` that is one write; otherwise the tree is frozen so nothing
/// can fork while it is killed, then thawed so the signals land.
pub fn kill_tree(layout: &Layout, rel: &str) -> Result<usize, CgroupError> {
    let dirs = layout.dirs(rel);
    if !dirs.iter().any(|d| d.exists()) {
        return Ok(0);
    }
    if let Layout::V2 { .. } = layout {
        let kill_file = dirs[0].join("cgroup.kill");
        if kill_file.exists() {
            let n = pids_in_tree(&dirs[0]).len();
            fs::write(&kill_file, "1").map_err(|source| CgroupError::Write {
                path: kill_file,
                source,
            })?;
            return Ok(n);
        }
    }
    let freezer = layout.freezer_dir(rel).filter(|d| d.exists());
    if let Some(f) = &freezer {
        set_frozen(layout, f, true)?;
    }
    let mut pids: Vec<i32> = dirs.iter().flat_map(|d| pids_in_tree(d)).collect();
    pids.sort_unstable();
    pids.dedup();
    for p in &pids {
        let _ = kill(Pid::from_raw(*p), Signal::SIGKILL);
    }
    if let Some(f) = &freezer {
        set_frozen(layout, f, false)?;
    }
    Ok(pids.len())
}

/// Kills everything in the tree, waits for it to empty, and removes every
/// directory depth-first (rmdir of a non-empty cgroup fails, and so does
/// libcontainer's delete when children exist).
///
/// `grace` is how long the tree may take to empty on its own before it is
/// killed from here: when the caller already killed the run's init, its pid
/// namespace takes everything with it, and freezing a v1 cgroup full of
/// dying tasks costs ~20 ms (measured) against ~1 ms for them to go.
pub fn destroy_tree(
    layout: &Layout,
    rel: &str,
    grace: Duration,
    wait: Duration,
) -> Result<(), CgroupError> {
    let start = Instant::now();
    let deadline = start + wait;
    let mut last_kill: Option<Instant> = None;
    loop {
        let Err(e) = remove_tree(layout, rel) else {
            return Ok(());
        };
        if Instant::now() >= deadline {
            return Err(e);
        }
        let due = match last_kill {
            None => start.elapsed() >= grace,
            Some(t) => t.elapsed() > Duration::from_millis(50),
        };
        if due {
            tracing::debug!(error = %e, "cgroup not empty yet; killing what is left");
            let _ = kill_tree(layout, rel);
            last_kill = Some(Instant::now());
        }
        sleep(Duration::from_micros(200));
    }
}

/// Removes `rel` and its descendants depth-first, without killing.
pub fn remove_tree(layout: &Layout, rel: &str) -> Result<(), CgroupError> {
    for d in layout.dirs(rel) {
        remove_depth_first(&d)?;
    }
    Ok(())
}

fn remove_depth_first(dir: &Path) -> Result<(), CgroupError> {
    let rd = match fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(source) => {
            return Err(CgroupError::Read {
                path: dir.to_path_buf(),
                source,
            })
        }
    };
    for e in rd.flatten() {
        if e.file_type().is_ok_and(|t| t.is_dir()) {
            remove_depth_first(&e.path())?;
        }
    }
    match fs::remove_dir(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(CgroupError::Remove {
            path: dir.to_path_buf(),
            source,
        }),
    }
}

/// Removes `rel` if it is empty; a busy cgroup is left in place.
pub fn remove_if_empty(layout: &Layout, rel: &str) {
    for d in layout.dirs(rel) {
        let _ = fs::remove_dir(d);
    }
}

/// The cgroup2 mount in `/proc/self/mountinfo` text (the unified root of a
/// v2 host, or the controller-less one of a hybrid host) and its
/// superblock options. Pure.
pub fn cgroup2_mount(mountinfo: &str) -> Option<(PathBuf, Vec<String>)> {
    mountinfo.lines().find_map(|line| {
        let (left, right) = line.split_once(" - ")?;
        let mount_point = left.split(' ').nth(4)?;
        let mut right = right.split(' ');
        if right.next()? != "cgroup2" {
            return None;
        }
        let opts = right.nth(1)?.split(',').map(str::to_string).collect();
        Some((PathBuf::from(mount_point), opts))
    })
}

/// The cgroup2 flags a reconfigure must repeat: a cgroup2 reconfigure
/// sets every root flag from what it is given, so one left out is cleared.
const CGROUP2_FLAGS: &[&str] = &[
    "nsdelegate",
    "favordynmods",
    "memory_localevents",
    "memory_recursiveprot",
    "memory_hugetlb_accounting",
    "pids_localevents",
];

/// What [`favor_dynmods`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DynMods {
    AlreadyOn(PathBuf),
    TurnedOn(PathBuf),
    NoCgroup2,
}

/// Sets `favordynmods` on the host's cgroup2 superblock, keeping its other
/// flags. Moving a task between cgroups takes the kernel's global
/// threadgroup rwsem for writing; without the flag every first move after a
/// quiet moment waits for an RCU grace period (7–12 ms measured on this
/// kernel, HZ=250, on each create and each exec). The semaphore is global,
/// so the flag on the (even controller-less) cgroup2 mount also speeds up
/// v1 moves on a hybrid host. The price, per the kernel's cgroup-v2 docs, is
/// a slightly slower fork and exit host-wide. Needs Linux 6.0.
pub fn favor_dynmods() -> Result<DynMods, CgroupError> {
    let path = PathBuf::from("/proc/self/mountinfo");
    let text = fs::read_to_string(&path).map_err(|source| CgroupError::Read { path, source })?;
    let Some((mount_point, opts)) = cgroup2_mount(&text) else {
        return Ok(DynMods::NoCgroup2);
    };
    if opts.iter().any(|o| o == "favordynmods") {
        return Ok(DynMods::AlreadyOn(mount_point));
    }
    let err = |source: rustix::io::Errno| CgroupError::Write {
        path: mount_point.clone(),
        source: source.into(),
    };
    let fs = rustix::mount::fspick(
        rustix::fs::CWD,
        &mount_point,
        rustix::mount::FsPickFlags::FSPICK_CLOEXEC,
    )
    .map_err(err)?;
    for flag in opts
        .iter()
        .filter(|o| CGROUP2_FLAGS.contains(&o.as_str()))
        .map(String::as_str)
        .chain(["favordynmods"])
    {
        rustix::mount::fsconfig_set_flag(&fs, flag).map_err(err)?;
    }
    rustix::mount::fsconfig_reconfigure(&fs).map_err(err)?;
    Ok(DynMods::TurnedOn(mount_point))
}

/// Child cgroup names directly under `rel` (the runs under a daemon's parent).
pub fn children(layout: &Layout, rel: &str) -> Vec<String> {
    let mut names = Vec::new();
    for d in layout.dirs(rel) {
        if let Ok(rd) = fs::read_dir(&d) {
            for e in rd.flatten() {
                if e.file_type().is_ok_and(|t| t.is_dir()) {
                    let n = e.file_name().to_string_lossy().into_owned();
                    if !names.contains(&n) {
                        names.push(n);
                    }
                }
            }
        }
    }
    names
}

#[cfg(test)]
mod tests {
    use super::*;

    const HYBRID: &str = "\
30 23 0:26 / /sys/fs/cgroup ro,nosuid,nodev,noexec shared:9 - tmpfs tmpfs ro,mode=755
31 30 0:27 / /sys/fs/cgroup/unified rw,nosuid,nodev,noexec,relatime shared:10 - cgroup2 cgroup2 rw,nsdelegate
32 30 0:28 / /sys/fs/cgroup/systemd rw,nosuid,nodev,noexec,relatime shared:11 - cgroup cgroup rw,xattr,name=systemd
33 30 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid,nodev,noexec,relatime shared:12 - cgroup cgroup rw,cpu,cpuacct
34 30 0:30 / /sys/fs/cgroup/memory rw,nosuid,nodev,noexec,relatime shared:13 - cgroup cgroup rw,memory
35 30 0:31 / /sys/fs/cgroup/pids rw,nosuid,nodev,noexec,relatime shared:14 - cgroup cgroup rw,pids
36 30 0:32 / /sys/fs/cgroup/freezer rw,nosuid,nodev,noexec,relatime shared:15 - cgroup cgroup rw,freezer
";
    const PURE_V2: &str = "\
30 23 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate,memory_recursiveprot
";

    #[test]
    fn cgroup2_mount_and_flags_are_found() {
        let hybrid =
            "40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd\n\
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n";
        assert_eq!(
            cgroup2_mount(hybrid),
            Some((
                PathBuf::from("/sys/fs/cgroup/unified"),
                vec!["rw".to_string()]
            ))
        );
        let v2 = "30 23 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate,memory_recursiveprot\n";
        let (mp, opts) = cgroup2_mount(v2).expect("v2 mount");
        assert_eq!(mp, PathBuf::from("/sys/fs/cgroup"));
        let kept: Vec<&str> = opts
            .iter()
            .map(String::as_str)
            .filter(|o| CGROUP2_FLAGS.contains(o))
            .collect();
        assert_eq!(kept, vec!["nsdelegate", "memory_recursiveprot"]);
        assert_eq!(
            cgroup2_mount("32 31 0:29 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n"),
            None
        );
    }

    #[test]
    fn hybrid_hosts_use_v1_controllers() {
        let l = Layout::from_mountinfo(HYBRID).expect("layout");
        let Layout::V1 { hierarchies } = &l else {
            panic!("expected v1, got {l:?}");
        };
        assert_eq!(hierarchies.len(), 4, "name=systemd and cgroup2 are skipped");
        assert_eq!(hierarchies[0].controllers, vec!["cpu", "cpuacct"]);
        assert_eq!(
            l.dirs("/sbx-1/run"),
            vec![
                PathBuf::from("/sys/fs/cgroup/cpu,cpuacct/sbx-1/run"),
                PathBuf::from("/sys/fs/cgroup/memory/sbx-1/run"),
                PathBuf::from("/sys/fs/cgroup/pids/sbx-1/run"),
                PathBuf::from("/sys/fs/cgroup/freezer/sbx-1/run"),
            ]
        );
    }

    #[test]
    fn pure_v2_hosts_use_the_unified_tree() {
        let l = Layout::from_mountinfo(PURE_V2).expect("layout");
        assert_eq!(
            l,
            Layout::V2 {
                root: "/sys/fs/cgroup".into()
            }
        );
        assert_eq!(
            l.dirs("/sbx-1/run"),
            vec![PathBuf::from("/sys/fs/cgroup/sbx-1/run")]
        );
    }

    #[test]
    fn no_cgroups_is_an_error() {
        assert!(matches!(
            Layout::from_mountinfo("1 0 0:1 / / rw - ext4 /dev/vda rw"),
            Err(CgroupError::NoHierarchy)
        ));
    }

    #[test]
    fn v2_fixture_create_lists_and_removes_depth_first() {
        let tmp = tempfile::tempdir().expect("tmp");
        let l = Layout::V2 {
            root: tmp.path().to_path_buf(),
        };
        let dirs = create(&l, "/sbx-1").expect("parent");
        assert_eq!(dirs, vec![tmp.path().join("sbx-1")]);
        create(&l, "/sbx-1/runA").expect("run");
        create(&l, "/sbx-1/runA/exec-1").expect("exec");
        fs::write(tmp.path().join("sbx-1/runA/exec-1/cgroup.procs"), "").expect("procs");
        assert_eq!(children(&l, "/sbx-1"), vec!["runA".to_string()]);
        // A fixture tree has plain files where the kernel has virtual ones
        // that rmdir ignores; remove ours to stand in for that.
        fs::remove_file(tmp.path().join("sbx-1/runA/exec-1/cgroup.procs")).expect("rm");
        remove_tree(&l, "/sbx-1/runA").expect("remove");
        assert!(!tmp.path().join("sbx-1/runA").exists());
        assert!(tmp.path().join("sbx-1").exists());
    }

    #[test]
    fn v2_fixture_kill_uses_cgroup_kill() {
        let tmp = tempfile::tempdir().expect("tmp");
        let l = Layout::V2 {
            root: tmp.path().to_path_buf(),
        };
        create(&l, "/r").expect("create");
        // pids that cannot exist (above pid_max) so no real process is hit.
        fs::write(
            tmp.path().join("r/cgroup.procs"),
            "2147483000\n2147483001\n",
        )
        .expect("procs");
        fs::write(tmp.path().join("r/cgroup.kill"), "").expect("kill file");
        assert_eq!(kill_tree(&l, "/r").expect("kill"), 2);
        assert_eq!(
            fs::read_to_string(tmp.path().join("r/cgroup.kill")).expect("read"),
            "1"
        );
    }

    #[test]
    fn v2_fixture_without_cgroup_kill_freezes_and_thaws() {
        let tmp = tempfile::tempdir().expect("tmp");
        let l = Layout::V2 {
            root: tmp.path().to_path_buf(),
        };
        create(&l, "/r").expect("create");
        fs::write(tmp.path().join("r/cgroup.procs"), "2147483000\n").expect("procs");
        assert_eq!(kill_tree(&l, "/r").expect("kill"), 1);
        assert_eq!(
            fs::read_to_string(tmp.path().join("r/cgroup.freeze")).expect("read"),
            "0"
        );
    }

    #[test]
    fn v1_cpuset_children_inherit_cpus_and_mems() {
        let tmp = tempfile::tempdir().expect("tmp");
        fs::write(tmp.path().join("cpuset.cpus"), "0-1\n").expect("cpus");
        fs::write(tmp.path().join("cpuset.mems"), "0\n").expect("mems");
        let child = tmp.path().join("c");
        fs::create_dir(&child).expect("child");
        fs::write(child.join("cpuset.cpus"), "\n").expect("cpus");
        fs::write(child.join("cpuset.mems"), "").expect("mems");
        inherit_cpuset(&child).expect("inherit");
        assert_eq!(
            fs::read_to_string(child.join("cpuset.cpus")).expect("read"),
            "0-1"
        );
        assert_eq!(
            fs::read_to_string(child.join("cpuset.mems")).expect("read"),
            "0"
        );
    }

    /// A v1 layout with one hierarchy per controller under `root`, each
    /// holding the run cgroup `/sbx-1/run`.
    fn v1_fixture(root: &Path, controllers: &[&str]) -> Layout {
        let hierarchies = controllers
            .iter()
            .map(|c| {
                let mp = root.join(c);
                fs::create_dir_all(mp.join("sbx-1/run")).expect("run cgroup");
                Hierarchy {
                    mount_point: mp,
                    controllers: vec![c.to_string()],
                }
            })
            .collect();
        Layout::V1 { hierarchies }
    }

    #[test]
    fn v1_exec_cgroups_are_made_only_where_killing_needs_them() {
        let tmp = tempfile::tempdir().expect("tmp");
        let l = v1_fixture(tmp.path(), &["memory", "freezer", "pids"]);
        join_exec(&l, "/sbx-1/run/exec-1", 4242).expect("join");
        let read = |p: &str| fs::read_to_string(tmp.path().join(p)).unwrap_or_default();
        assert_eq!(read("memory/sbx-1/run/cgroup.procs"), "4242");
        assert!(!tmp.path().join("memory/sbx-1/run/exec-1").exists());
        assert_eq!(read("freezer/sbx-1/run/exec-1/cgroup.procs"), "4242");
        assert_eq!(read("pids/sbx-1/run/exec-1/cgroup.procs"), "4242");
    }

    #[test]
    fn the_two_halves_of_a_join_split_at_the_exec_cgroup() {
        // v1: the shared half touches only the run's cgroups, the own half
        // only the exec's (the exec standby joins in two steps).
        let tmp = tempfile::tempdir().expect("tmp");
        let l = v1_fixture(tmp.path(), &["cpu", "freezer"]);
        let read = |p: &str| fs::read_to_string(tmp.path().join(p)).unwrap_or_default();
        join_run_shared(&l, "/sbx-1/run", 7).expect("shared");
        assert_eq!(read("cpu/sbx-1/run/cgroup.procs"), "7");
        assert!(!tmp.path().join("freezer/sbx-1/run/cgroup.procs").exists());
        assert!(!tmp.path().join("freezer/sbx-1/run/exec-2").exists());
        join_exec_own(&l, "/sbx-1/run/exec-2", 7).expect("own");
        assert_eq!(read("freezer/sbx-1/run/exec-2/cgroup.procs"), "7");
        assert!(!tmp.path().join("cpu/sbx-1/run/exec-2").exists());

        // v2: nothing is shared; the exec's cgroup is the whole join.
        let v2 = tempfile::tempdir().expect("tmp");
        fs::create_dir_all(v2.path().join("sbx-1/run")).expect("run cgroup");
        let l = Layout::V2 {
            root: v2.path().to_path_buf(),
        };
        join_run_shared(&l, "/sbx-1/run", 9).expect("shared");
        assert!(!v2.path().join("sbx-1/run/cgroup.procs").exists());
        join_exec_own(&l, "/sbx-1/run/exec-3", 9).expect("own");
        assert_eq!(
            fs::read_to_string(v2.path().join("sbx-1/run/exec-3/cgroup.procs")).expect("read"),
            "9"
        );
    }

    #[test]
    fn swap_accounting_follows_memsw_on_v1() {
        let tmp = tempfile::tempdir().expect("tmp");
        let l = Layout::V1 {
            hierarchies: vec![Hierarchy {
                mount_point: tmp.path().to_path_buf(),
                controllers: vec!["memory".into()],
            }],
        };
        assert!(!l.swap_accounting());
        fs::write(tmp.path().join("memory.memsw.limit_in_bytes"), "").expect("write");
        assert!(l.swap_accounting());
    }
}
