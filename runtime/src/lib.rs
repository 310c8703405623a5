//! Turns a run spec into a live sandbox: the OCI spec, libcontainer (in the
//! single-threaded shim), cgroups v1 and v2, the default seccomp profile,
//! exec into a run, and teardown.

pub mod cgroups;
pub mod exec;
pub mod execsrv;
pub mod fdpass;
pub mod init;
pub mod seccomp;
pub mod shim;
pub mod spec;
mod vspawn;

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

pub use cgroups::Layout;
pub use spec::{BindMount, Limits, RunSpec};

/// The files of one run under `<state>/runs/<id>`.
#[derive(Debug, Clone)]
pub struct RunPaths {
    pub dir: PathBuf,
}

impl RunPaths {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        RunPaths { dir: dir.into() }
    }
    pub fn bundle(&self) -> PathBuf {
        self.dir.join("bundle")
    }
    pub fn rootfs(&self) -> PathBuf {
        self.dir.join("rootfs")
    }
    pub fn upper(&self) -> PathBuf {
        self.dir.join("upper")
    }
    pub fn overlay_work(&self) -> PathBuf {
        self.dir.join("ovlwork")
    }
    /// libcontainer's state root.
    pub fn container_root(&self) -> PathBuf {
        self.dir.join("lc")
    }
    pub fn shim_state(&self) -> PathBuf {
        self.dir.join("shim.json")
    }
    pub fn shim_log(&self) -> PathBuf {
        self.dir.join("shim.log")
    }
    pub fn exit_file(&self) -> PathBuf {
        self.dir.join("exit")
    }
    /// The shim's exec socket (see `exec::serve`).
    pub fn exec_socket(&self) -> PathBuf {
        self.dir.join("exec.sock")
    }
}

/// What the shim records once the run's init is running.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ShimState {
    pub shim_pid: i32,
    pub shim_start: u64,
    pub init_pid: i32,
    pub init_start: u64,
}

impl ShimState {
    pub fn load(paths: &RunPaths) -> io::Result<ShimState> {
        let text = fs::read(paths.shim_state())?;
        serde_json::from_slice(&text).map_err(io::Error::other)
    }

    pub fn shim_alive(&self) -> bool {
        alive(self.shim_pid, self.shim_start)
    }

    pub fn init_alive(&self) -> bool {
        alive(self.init_pid, self.init_start)
    }
}

/// Whether the process `pid` started at `start` is still running (a zombie
/// waiting to be reaped counts as gone).
pub fn alive(pid: i32, start: u64) -> bool {
    let Ok(text) = fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    let state = text
        .rfind(')')
        .and_then(|i| text[i + 1..].split_whitespace().next());
    !matches!(state, Some("Z") | Some("X")) && parse_start_time(&text) == Some(start)
}

/// A process's start time (clock ticks since boot, field 22 of
/// `/proc/<pid>/stat`): with the pid, it names one process across pid reuse.
pub fn start_time(pid: i32) -> Option<u64> {
    let text = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_start_time(&text)
}

fn parse_start_time(stat: &str) -> Option<u64> {
    // The command name may hold spaces and parentheses: split after the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// Writes `body` to `path` atomically (temp file + rename).
pub fn write_atomic(path: &Path, body: &[u8]) -> io::Result<()> {
    let tmp = path.with_extension("tmp");
    fs::write(&tmp, body)?;
    fs::rename(tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn start_time_survives_odd_command_names() {
        let stat =
            "42 (a) b (c)) S 1 42 42 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 1000 100";
        assert_eq!(parse_start_time(stat), Some(987654));
    }

    #[test]
    fn own_start_time_is_readable() {
        let me = std::process::id() as i32;
        assert!(start_time(me).is_some_and(|t| t > 0));
        assert_eq!(start_time(-5), None);
    }
}
