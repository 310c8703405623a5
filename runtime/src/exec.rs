//! `sbx exec-helper`: a fresh single-threaded process the daemon spawns per
//! exec when the run's shim cannot take it (see `execsrv`, the usual path;
//! both share [`child`]). It moves itself into the exec's own cgroup (so a timeout can kill
//! everything the exec started, daemonized grandchildren included, from
//! outside the run), enters the run's namespaces through a pidfd of the
//! run's init, forks the command's process inside the run's pid namespace,
//! drops to the run's user with no capabilities, loads the seccomp profile,
//! and execs. It exits with the command's status (128+signal when killed).
//!
//! The request arrives on stdin as a 4-byte little-endian length and JSON,
//! so env values never appear in argv or in the host's process list; the
//! rest of stdin is the command's stdin.

#![allow(unsafe_code)]

use std::io::Read;
use std::os::fd::{AsFd, FromRawFd, OwnedFd};

use nix::sched::{setns, CloneFlags};
use nix::sys::wait::{waitpid, WaitStatus};
use nix::unistd::{fork, ForkResult};
use serde::{Deserialize, Serialize};

use crate::cgroups::{self, Layout};

/// What the daemon asks of one exec.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ExecRequest {
    pub init_pid: i32,
    pub init_start: u64,
    /// The exec's own cgroup, relative to each hierarchy root.
    pub cgroup: String,
    pub argv: Vec<String>,
    /// The whole environment, `KEY=VALUE`.
    pub env: Vec<String>,
    pub cwd: String,
    pub uid: u32,
    pub gid: u32,
    /// The seccomp profile precompiled to BPF (see `seccomp::export_bpf`);
    /// compiled here when absent.
    #[serde(default)]
    pub seccomp_bpf: Option<std::path::PathBuf>,
}

/// Exit status the helper uses when it could not start the command.
pub const EXIT_CANNOT_ENTER: i32 = 125;
pub const EXIT_NOT_EXECUTABLE: i32 = 126;
pub const EXIT_NOT_FOUND: i32 = 127;

/// Encodes a request the way [`helper_main`] reads it.
pub fn encode_request(req: &ExecRequest) -> Vec<u8> {
    let body = serde_json::to_vec(req).unwrap_or_default();
    let mut out = (body.len() as u32).to_le_bytes().to_vec();
    out.extend(body);
    out
}

fn read_request() -> std::io::Result<ExecRequest> {
    // Exact reads on the raw fd: nothing past the request may be consumed,
    // the rest of stdin belongs to the command.
    // SAFETY: fd 0 is open for the life of the process; ManuallyDrop keeps it open.
    let mut stdin = std::mem::ManuallyDrop::new(unsafe { std::fs::File::from_raw_fd(0) });
    let mut len = [0u8; 4];
    stdin.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > 1 << 20 {
        return Err(std::io::Error::other("exec request too large"));
    }
    let mut body = vec![0u8; len];
    stdin.read_exact(&mut body)?;
    serde_json::from_slice(&body).map_err(std::io::Error::other)
}

/// Writes `sbx: <msg>` to an exec's stderr (`to`).
pub(crate) fn say(to: impl AsFd, msg: &str) {
    let _ = nix::unistd::write(to, format!("sbx: {msg}\n").as_bytes());
}

/// Says `msg` on this process's stderr; returns `code`.
pub(crate) fn fail(code: i32, msg: &str) -> i32 {
    say(std::io::stderr(), msg);
    code
}

/// Entry point; returns the exit code for the helper process.
pub fn helper_main() -> i32 {
    let req = match read_request() {
        Ok(r) => r,
        Err(e) => return fail(EXIT_CANNOT_ENTER, &format!("read exec request: {e}")),
    };
    let layout = match Layout::detect() {
        Ok(l) => l,
        Err(e) => return fail(EXIT_CANNOT_ENTER, &format!("cgroups: {e}")),
    };
    if let Err(e) = cgroups::join_exec(&layout, &req.cgroup, std::process::id()) {
        return fail(EXIT_CANNOT_ENTER, &format!("join exec cgroup: {e}"));
    }
    // Read on the host's side, before entering the run's mount namespace.
    let bpf = match &req.seccomp_bpf {
        Some(p) => match std::fs::read(p) {
            Ok(b) => Some(b),
            Err(e) => {
                return fail(
                    EXIT_CANNOT_ENTER,
                    &format!("seccomp profile {}: {e}", p.display()),
                )
            }
        },
        None => None,
    };
    let pidfd = match pidfd_open(req.init_pid) {
        Ok(fd) => fd,
        Err(e) => return fail(EXIT_CANNOT_ENTER, &format!("run is not running: {e}")),
    };
    // The pidfd pins the process; check it is still the run's init.
    if crate::start_time(req.init_pid) != Some(req.init_start) {
        return fail(EXIT_CANNOT_ENTER, "run is not running");
    }
    // Into the pid namespace too: this helper forks the command below.
    if let Err(e) = setns(pidfd.as_fd(), run_namespaces() | CloneFlags::CLONE_NEWPID) {
        return fail(EXIT_CANNOT_ENTER, &format!("enter run namespaces: {e}"));
    }
    drop(pidfd);
    // SAFETY: this process is single-threaded (a fresh exec of the sbx
    // binary that started no threads), so the child may run arbitrary code.
    match unsafe { fork() } {
        Err(e) => fail(EXIT_CANNOT_ENTER, &format!("fork in run: {e}")),
        Ok(ForkResult::Child) => {
            let code = child(&req, bpf.as_deref());
            // SAFETY: _exit is always safe; no destructors should run in the child.
            unsafe { libc::_exit(code) }
        }
        Ok(ForkResult::Parent { child }) => {
            // The command alone holds the stdio pipes from here on.
            for fd in 0..3 {
                let _ = nix::unistd::close(fd);
            }
            loop {
                match waitpid(child, None) {
                    Ok(WaitStatus::Exited(_, code)) => return code,
                    Ok(WaitStatus::Signaled(_, sig, _)) => return 128 + sig as i32,
                    Ok(_) => continue,
                    Err(nix::errno::Errno::EINTR) => continue,
                    Err(_) => return EXIT_CANNOT_ENTER,
                }
            }
        }
    }
}

/// The run's namespaces an exec enters, beside its pid namespace (which
/// only a fork after setns can be in).
pub(crate) fn run_namespaces() -> CloneFlags {
    CloneFlags::CLONE_NEWNS
        | CloneFlags::CLONE_NEWNET
        | CloneFlags::CLONE_NEWUTS
        | CloneFlags::CLONE_NEWIPC
        | CloneFlags::CLONE_NEWCGROUP
}

pub(crate) fn pidfd_open(pid: i32) -> std::io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the kernel just returned this fd to us; nobody else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// Puts every ignored signal back to its default action. SIG_IGN
/// survives execve, and the shim and helper inherit ignores from whoever
/// started the daemon (nohup: SIGHUP; a background shell job: SIGINT and
/// SIGQUIT) and from Rust's runtime (SIGPIPE): without this, a `yes | head`
/// in a run would never see its SIGPIPE.
pub fn reset_signal_dispositions() {
    // The kernel's struct sigaction (glibc's wrapper refuses the two
    // signals it keeps for itself, 32 and 33, which can be inherited as
    // ignored too).
    #[repr(C)]
    struct KernelSigaction {
        handler: usize,
        flags: u64,
        restorer: usize,
        mask: u64,
    }
    let dfl = KernelSigaction {
        handler: libc::SIG_DFL,
        flags: 0,
        restorer: 0,
        mask: 0,
    };
    for sig in 1..=64 {
        if sig == libc::SIGKILL || sig == libc::SIGSTOP {
            continue;
        }
        let mut old = KernelSigaction {
            handler: libc::SIG_DFL,
            flags: 0,
            restorer: 0,
            mask: 0,
        };
        // Only ignored signals are reset: a handler (glibc's own, for 32 and
        // 33 in a threaded process) is left alone here and dropped by execve.
        // SAFETY: both structs outlive the calls and match the kernel's
        // layout (size 8 for the mask).
        unsafe {
            let read = libc::syscall(
                libc::SYS_rt_sigaction,
                sig,
                std::ptr::null::<KernelSigaction>(),
                &mut old as *mut KernelSigaction,
                8usize,
            );
            if read == 0 && old.handler == libc::SIG_IGN {
                libc::syscall(
                    libc::SYS_rt_sigaction,
                    sig,
                    &dfl as *const KernelSigaction,
                    std::ptr::null_mut::<KernelSigaction>(),
                    8usize,
                );
            }
        }
    }
}

/// Installs a classic BPF seccomp program (libseccomp's export format:
/// native-endian `sock_filter` records). `no_new_privs` must already be set.
fn load_bpf(prog: &[u8]) -> std::io::Result<()> {
    if prog.is_empty() || !prog.len().is_multiple_of(8) || prog.len() / 8 > usize::from(u16::MAX) {
        return Err(std::io::Error::other("malformed BPF program"));
    }
    let mut filters: Vec<libc::sock_filter> = prog
        .chunks_exact(8)
        .map(|c| libc::sock_filter {
            code: u16::from_ne_bytes([c[0], c[1]]),
            jt: c[2],
            jf: c[3],
            k: u32::from_ne_bytes([c[4], c[5], c[6], c[7]]),
        })
        .collect();
    let fprog = libc::sock_fprog {
        len: filters.len() as u16,
        filter: filters.as_mut_ptr(),
    };
    // SAFETY: `fprog` points at `filters`, which outlives the call; the
    // kernel copies the program and validates it.
    let rc = unsafe {
        libc::prctl(
            libc::PR_SET_SECCOMP,
            libc::SECCOMP_MODE_FILTER,
            &fprog as *const libc::sock_fprog,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Runs in the forked child, inside the run's namespaces; returns only on error.
pub(crate) fn child(req: &ExecRequest, bpf: Option<&[u8]>) -> i32 {
    if let Err(msg) = confine(bpf) {
        return fail(EXIT_CANNOT_ENTER, &msg);
    }
    crate::vspawn::exec_here(req)
}

/// What an exec's process does before it needs to know its command: every
/// signal back to its default, no bounding set, the run's open-file limit,
/// no_new_privs and the run's seccomp filter. The filter allows all that
/// `vspawn`'s plan still does (setgroups, setresuid, capset, chdir, execve),
/// so an exec standby can be confined before its request arrives.
pub(crate) fn confine(bpf: Option<&[u8]>) -> Result<(), String> {
    reset_signal_dispositions();
    // Drop the bounding set while we still hold CAP_SETPCAP.
    for cap in caps::all() {
        let _ = caps::drop(None, caps::CapSet::Bounding, cap);
    }
    let nofile = crate::spec::nofile_limit();
    let _ =
        nix::sys::resource::setrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE, nofile, nofile);
    nix::sys::prctl::set_no_new_privs().map_err(|e| format!("no_new_privs: {e}"))?;
    match bpf {
        Some(prog) => load_bpf(prog).map_err(|e| format!("seccomp: {e}")),
        None => crate::seccomp::load().map_err(|e| format!("seccomp: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_round_trips_with_length_prefix() {
        let req = ExecRequest {
            init_pid: 7,
            init_start: 99,
            cgroup: "/sbx-1/r/exec-1".into(),
            argv: vec!["true".into()],
            env: vec!["SECRET=x".into()],
            cwd: "/work".into(),
            uid: 1000,
            gid: 1000,
            seccomp_bpf: None,
        };
        let bytes = encode_request(&req);
        let len = u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]) as usize;
        assert_eq!(len, bytes.len() - 4);
        let back: ExecRequest = serde_json::from_slice(&bytes[4..]).expect("json");
        assert_eq!(back.env, vec!["SECRET=x".to_string()]);
    }
}
