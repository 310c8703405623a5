//! How an exec standby starts a command: with `clone(CLONE_VM |
//! CLONE_VFORK | CLONE_PARENT)`, staying what it is for the next one.
//!
//! The standby (see `execsrv`) is a fork of the shim that joined the run's
//! shared cgroups, entered its namespaces and installed its seccomp filter
//! once. Each command is a `CLONE_VM` child of it: no page tables are
//! copied for it and none are torn down when it execs (the standby's own
//! `execve` had spent ~60% of its samples in `exit_mmap`), and nothing is
//! confined again. With `CLONE_PARENT` the command is the shim's child, so
//! the shim reaps it as any exec. Its first act is one byte on the control
//! socket, whose other end has `SO_PASSCRED`: the kernel tells the shim its
//! pid, in the shim's pid namespace, race-free even if it ends at once.
//! Then it joins the exec's own cgroups by writing "0" to the
//! `cgroup.procs` files the shim opened, takes the exec's stdio, becomes
//! the exec's user without capabilities, and execs.
//!
//! Until it execs, the child runs on the standby's memory with the
//! standby suspended (`CLONE_VFORK`): it only makes system calls on what
//! [`Plan`] prepared, allocates nothing and cannot unwind.
//!
//! The fork path (a command forked by the shim, or by `sbx exec-helper`)
//! ends the same way, in place: [`exec_here`] runs the same steps over the
//! same plan, so both paths drop privileges, search `PATH`, exit and word
//! their failures alike.

#![allow(unsafe_code)]

use std::ffi::{c_char, c_int, c_void, CString};
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};

use crate::exec::{ExecRequest, EXIT_CANNOT_ENTER, EXIT_NOT_EXECUTABLE, EXIT_NOT_FOUND};

/// Where the command's process stopped when it could not exec.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    Cgroup = 1,
    Stdio,
    Setgroups,
    Setgid,
    Setuid,
    Capabilities,
    Cwd,
    NotFound,
    Exec,
}

impl Stage {
    fn from_i32(v: i32) -> Option<Stage> {
        [
            Stage::Cgroup,
            Stage::Stdio,
            Stage::Setgroups,
            Stage::Setgid,
            Stage::Setuid,
            Stage::Capabilities,
            Stage::Cwd,
            Stage::NotFound,
            Stage::Exec,
        ]
        .into_iter()
        .find(|s| *s as i32 == v)
    }
}

/// The exit code of a process that stopped at `stage` with `errno`.
fn exit_code(stage: Stage, errno: i32) -> i32 {
    match stage {
        Stage::Cwd | Stage::NotFound => EXIT_NOT_FOUND,
        Stage::Exec if errno == libc::ENOENT => EXIT_NOT_FOUND,
        Stage::Exec => EXIT_NOT_EXECUTABLE,
        _ => EXIT_CANNOT_ENTER,
    }
}

/// The exit code and message for a failed stage. Pure.
fn failure(stage: Stage, errno: i32, req: &ExecRequest, path: &str) -> (i32, String) {
    let e = nix::errno::Errno::from_raw(errno);
    let argv0 = req.argv.first().map(String::as_str).unwrap_or_default();
    let msg = match stage {
        Stage::Cgroup => format!("join exec cgroup: {e}"),
        Stage::Stdio => format!("stdio: {e}"),
        Stage::Setgroups => format!("setgroups: {e}"),
        Stage::Setgid => format!("setgid: {e}"),
        Stage::Setuid => format!("setuid: {e}"),
        Stage::Capabilities => format!("drop capabilities: {e}"),
        Stage::Cwd => format!("cwd {}: {e}", req.cwd),
        Stage::NotFound => format!("{argv0}: command not found"),
        Stage::Exec if e == nix::errno::Errno::ENOENT => format!("{path}: not found"),
        Stage::Exec => format!("{path}: {e}"),
    };
    (exit_code(stage, errno), msg)
}

/// The paths `execve` is tried on: the command itself when it names a
/// path, else each `PATH` entry's (the first the user may execute wins).
/// Pure.
fn candidates(argv0: &str, env: &[String]) -> (bool, Vec<String>) {
    if argv0.contains('/') {
        return (true, vec![argv0.to_string()]);
    }
    let path = env
        .iter()
        .find_map(|e| e.strip_prefix("PATH="))
        .unwrap_or(crate::spec::DEFAULT_PATH);
    let list = path
        .split(':')
        .filter(|d| !d.is_empty())
        .map(|d| format!("{d}/{argv0}"))
        .collect();
    (false, list)
}

/// Everything the command's process needs, prepared before it exists.
struct Plan {
    /// The control socket to report on (the standby's children).
    report: Option<c_int>,
    /// Why the request cannot run at all: the process exits at once, with
    /// [`EXIT_NOT_FOUND`] as on the fork path.
    refused: Option<&'static str>,
    cgroups: Vec<c_int>,
    /// The exec's stdio, to become 0, 1 and 2 (installed already when None).
    stdio: Option<[c_int; 3]>,
    gid: libc::gid_t,
    uid: libc::uid_t,
    cwd: CString,
    /// `execve` the first candidate as is (the command named a path).
    direct: bool,
    candidates: Vec<CString>,
    /// Own the strings `argv` and `envp` point into.
    _strings: (Vec<CString>, Vec<CString>),
    argv: Vec<*const c_char>,
    envp: Vec<*const c_char>,
    /// Written by the process when it could not exec.
    stage: AtomicI32,
    errno: AtomicI32,
    tried: AtomicUsize,
}

impl Plan {
    fn new(
        req: &ExecRequest,
        report: Option<RawFd>,
        stdio: Option<[RawFd; 3]>,
        cgroups: &[BorrowedFd<'_>],
    ) -> Plan {
        let to_c = |s: &str| CString::new(s.as_bytes());
        let argv0 = req.argv.first().map(String::as_str).unwrap_or_default();
        let (direct, paths) = candidates(argv0, &req.env);
        let strings = (
            req.argv
                .iter()
                .map(|s| to_c(s))
                .collect::<Result<Vec<_>, _>>(),
            req.env
                .iter()
                .map(|s| to_c(s))
                .collect::<Result<Vec<_>, _>>(),
            paths.iter().map(|s| to_c(s)).collect::<Result<Vec<_>, _>>(),
            to_c(&req.cwd),
        );
        let refused = match &strings {
            _ if req.argv.is_empty() => Some("empty command"),
            (Ok(_), Ok(_), Ok(_), Ok(_)) => None,
            _ => Some("command contains NUL"),
        };
        let (argv, env, cands, cwd) = match strings {
            (Ok(a), Ok(e), Ok(c), Ok(w)) => (a, e, c, w),
            _ => Default::default(),
        };
        let nul_terminated = |v: &[CString]| {
            v.iter()
                .map(|s| s.as_ptr())
                .chain(std::iter::once(std::ptr::null()))
                .collect::<Vec<_>>()
        };
        Plan {
            report,
            refused,
            cgroups: cgroups.iter().map(|f| f.as_raw_fd()).collect(),
            stdio,
            gid: req.gid,
            uid: req.uid,
            cwd,
            direct,
            candidates: cands,
            argv: nul_terminated(&argv),
            envp: nul_terminated(&env),
            _strings: (argv, env),
            stage: AtomicI32::new(0),
            errno: AtomicI32::new(0),
            tried: AtomicUsize::new(0),
        }
    }

    /// Once the process ran [`command_process`] and did not exec: its exit
    /// code and why. None when it exec'd.
    fn outcome(&self, req: &ExecRequest) -> Option<(i32, String)> {
        match Stage::from_i32(self.stage.load(Ordering::Relaxed)) {
            Some(stage) => {
                let tried = self.tried.load(Ordering::Relaxed);
                let path = self
                    .candidates
                    .get(tried)
                    .map(|c| c.to_string_lossy())
                    .unwrap_or_default();
                Some(failure(
                    stage,
                    self.errno.load(Ordering::Relaxed),
                    req,
                    &path,
                ))
            }
            None => self.refused.map(|m| (EXIT_NOT_FOUND, m.to_string())),
        }
    }

    /// The first candidate the process may execute (as it is now).
    /// System calls only: it runs in the command's process.
    fn choose(&self) -> Option<usize> {
        (0..self.candidates.len()).find(|&i| {
            // SAFETY: access reads a NUL-terminated string the Plan owns.
            self.direct || unsafe { libc::access(self.candidates[i].as_ptr(), libc::X_OK) } == 0
        })
    }
}

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: c_int,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

const CAP_VERSION_3: u32 = 0x2008_0522;

extern "C" fn command_process(arg: *mut c_void) -> c_int {
    // SAFETY: `arg` is a Plan that outlives this process's use of it: the
    // standby is suspended until its child execs or exits, and
    // `exec_here` holds it across the call.
    let plan = unsafe { &*(arg as *const Plan) };
    let stop = |stage: Stage| -> c_int {
        let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
        plan.errno.store(errno, Ordering::Relaxed);
        plan.stage.store(stage as i32, Ordering::Relaxed);
        exit_code(stage, errno)
    };
    // SAFETY: system calls on this process only, over memory the Plan owns
    // (NUL-terminated strings, null-terminated pointer arrays).
    unsafe {
        // First: the shim learns this pid from the kernel with this byte.
        if let Some(report) = plan.report {
            libc::write(report, b"s".as_ptr().cast(), 1);
        }
        if plan.refused.is_some() {
            return EXIT_NOT_FOUND;
        }
        for fd in &plan.cgroups {
            if libc::write(*fd, b"0".as_ptr().cast(), 1) != 1 {
                return stop(Stage::Cgroup);
            }
        }
        for (target, fd) in plan.stdio.iter().flatten().enumerate() {
            if libc::dup2(*fd, target as c_int) < 0 {
                return stop(Stage::Stdio);
            }
        }
        if libc::setgroups(1, &plan.gid) != 0 {
            return stop(Stage::Setgroups);
        }
        if libc::setresgid(plan.gid, plan.gid, plan.gid) != 0 {
            return stop(Stage::Setgid);
        }
        if libc::setresuid(plan.uid, plan.uid, plan.uid) != 0 {
            return stop(Stage::Setuid);
        }
        let header = CapHeader {
            version: CAP_VERSION_3,
            pid: 0,
        };
        let none = [CapData {
            effective: 0,
            permitted: 0,
            inheritable: 0,
        }; 2];
        if libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL,
            0,
            0,
            0,
        ) != 0
            || libc::syscall(libc::SYS_capset, &header, none.as_ptr()) != 0
        {
            return stop(Stage::Capabilities);
        }
        if libc::chdir(plan.cwd.as_ptr()) != 0 {
            return stop(Stage::Cwd);
        }
        let Some(i) = plan.choose() else {
            return stop(Stage::NotFound);
        };
        plan.tried.store(i, Ordering::Relaxed);
        libc::execve(
            plan.candidates[i].as_ptr(),
            plan.argv.as_ptr(),
            plan.envp.as_ptr(),
        );
        stop(Stage::Exec)
    }
}

/// Starts `req`'s command from the standby: `stdio` are the exec's
/// stdin, stdout and stderr, `cgroups` its own `cgroup.procs` files, and
/// `report` the control socket. Ok once the command's process exists (it
/// reports itself and its exit code is the exec's; when it could not exec,
/// this has said why on the exec's stderr). Err when there is no process:
/// the standby cannot go on.
pub(crate) fn spawn(
    req: &ExecRequest,
    stdio: [BorrowedFd<'_>; 3],
    cgroups: &[BorrowedFd<'_>],
    report: RawFd,
) -> Result<(), String> {
    let plan = Plan::new(
        req,
        Some(report),
        Some(stdio.map(|f| f.as_raw_fd())),
        cgroups,
    );
    // The child's stack: it makes system calls only, so 64 KiB is ample.
    let mut stack = vec![0u8; 64 << 10];
    let top = (stack.as_mut_ptr() as usize + stack.len()) & !15;
    // SAFETY: the child runs command_process on its own stack over `plan`
    // and `stack`, both alive until clone returns (CLONE_VFORK suspends us
    // until the child execs or exits, after which it uses neither).
    let pid = unsafe {
        libc::clone(
            command_process,
            top as *mut c_void,
            libc::CLONE_VM | libc::CLONE_VFORK | libc::CLONE_PARENT,
            &plan as *const Plan as *mut c_void,
        )
    };
    if pid < 0 {
        return Err(format!("fork in run: {}", std::io::Error::last_os_error()));
    }
    drop(stack);
    if let Some((_, msg)) = plan.outcome(req) {
        crate::exec::say(stdio[2], &msg);
    }
    Ok(())
}

/// The fork path's end, in this process (its stdio installed, confined):
/// becomes the request's user without capabilities and execs its command.
/// Returns only on error, with the exit code, having said why on stderr.
pub(crate) fn exec_here(req: &ExecRequest) -> i32 {
    let plan = Plan::new(req, None, None, &[]);
    let code = command_process(&plan as *const Plan as *mut c_void);
    match plan.outcome(req) {
        Some((code, msg)) => crate::exec::fail(code, &msg),
        None => code,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(argv: &[&str]) -> ExecRequest {
        ExecRequest {
            init_pid: 1,
            init_start: 1,
            cgroup: "/sbx/r/exec-1".into(),
            argv: argv.iter().map(|s| s.to_string()).collect(),
            env: vec![],
            cwd: "/work".into(),
            uid: 1000,
            gid: 1000,
            seccomp_bpf: None,
        }
    }

    #[test]
    fn candidates_follow_the_run_path() {
        assert_eq!(
            candidates("/bin/sh", &[]),
            (true, vec!["/bin/sh".to_string()])
        );
        let env = vec!["PATH=/a::/b".to_string()];
        assert_eq!(
            candidates("sh", &env),
            (false, vec!["/a/sh".to_string(), "/b/sh".to_string()])
        );
    }

    #[test]
    fn the_first_executable_candidate_is_chosen() {
        let mut r = req(&["/bin/sh"]);
        assert_eq!(Plan::new(&r, None, None, &[]).choose(), Some(0));
        r.argv = vec!["sh".into()];
        r.env = vec!["PATH=/nonexistent:/bin".into()];
        let plan = Plan::new(&r, None, None, &[]);
        let chosen = plan.choose().map(|i| plan.candidates[i].clone());
        assert_eq!(chosen.as_deref(), Some(c"/bin/sh"));
        r.argv = vec!["definitely-not-a-cmd-xyz".into()];
        r.env = vec![];
        assert_eq!(Plan::new(&r, None, None, &[]).choose(), None);
        // Refused before anything runs, with the fork path's words.
        r.argv = vec![];
        let plan = Plan::new(&r, None, None, &[]);
        assert_eq!(command_process(&plan as *const Plan as *mut c_void), 127);
        assert_eq!(plan.outcome(&r), Some((127, "empty command".to_string())));
    }

    #[test]
    fn failures_are_worded_and_coded_as_on_the_fork_path() {
        let r = req(&["nope"]);
        assert_eq!(
            failure(Stage::NotFound, 0, &r, ""),
            (127, "nope: command not found".to_string())
        );
        assert_eq!(failure(Stage::Exec, libc::ENOENT, &r, "/x").0, 127);
        assert_eq!(failure(Stage::Exec, libc::EACCES, &r, "/x").0, 126);
        assert_eq!(failure(Stage::Cwd, libc::ENOENT, &r, "").0, 127);
        assert_eq!(failure(Stage::Setuid, libc::EPERM, &r, "").0, 125);
        for s in 1..=9 {
            assert_eq!(Stage::from_i32(s).map(|s| s as i32), Some(s));
        }
        assert_eq!(Stage::from_i32(0), None);
    }
}
