//! The shim's exec server. The shim is single-threaded, already loaded and
//! the parent of the run's init, so it is the cheapest place to start a
//! command in the run: one fork of a small process instead of spawning a
//! fresh helper (whose exec and dynamic loading were ~2.5 of the ~4.4 ms an
//! exec took).
//!
//! Protocol on `<run>/exec.sock` (a stream socket, 0600, root only): the
//! daemon connects and sends the request as [`crate::exec::encode_request`]
//! frames it, with the command's stdin, stdout and stderr attached as
//! `SCM_RIGHTS` on the first byte. The shim answers one line when the
//! command's process has ended — `exit <code>` (128+signal when killed) —
//! or `error <message>` when it could not be started. The command runs in
//! the exec's own cgroup, so a timeout kills it from outside as before.
//!
//! The exec standby: the shim keeps one forked child in the run that has
//! done once everything an exec does before it knows its command — it
//! joined the run's shared v1 cgroups, entered the run's namespaces, reset
//! its signals, dropped its bounding set and installed the run's seccomp
//! filter — and waits on a socketpair. For each exec the shim makes the
//! exec's own cgroups, opens their `cgroup.procs` and sends the request,
//! the stdio and those files; the standby starts the command as a
//! `CLONE_VM | CLONE_VFORK | CLONE_PARENT` child (see `vspawn`) and waits
//! for the next. No fork of the shim, no confining and no address-space
//! teardown is left on an exec's path or in its CPU bill (a standby per
//! exec, forked and confined anew each time, cost ~0.35 ms more per exec
//! side by side). The standby is visible in the run as `sbx-exec` (root,
//! with capabilities, so the run's processes cannot ptrace it or read its
//! descriptors); it dies with the shim (PDEATHSIG) and with the run's pid
//! namespace, and a new one is forked when the shim is next idle. A
//! request it cannot serve — another seccomp program, a cgroup outside the
//! run — falls back to a fresh fork.

#![allow(unsafe_code)]

use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::time::Duration;

use nix::sched::{setns, CloneFlags};
use nix::sys::signal::{SigSet, SigmaskHow};
use nix::unistd::{fork, ForkResult, Pid};

use crate::cgroups::{self, Layout};
use crate::exec::{ExecRequest, EXIT_CANNOT_ENTER};
use crate::fdpass;
use crate::RunPaths;

/// Largest request accepted (argv, env and stdin are bounded far below).
const MAX_REQUEST: usize = 8 << 20;

/// One exec server per shim.
pub struct ExecServer {
    listener: UnixListener,
    layout: Layout,
    /// The run's init, pinned: namespaces are entered through it.
    init: OwnedFd,
    /// Commands started and not yet reaped, with the connection to answer.
    running: Vec<(Pid, UnixStream)>,
    /// Connections whose command the standby is starting, oldest first:
    /// each gets the next pid the standby's commands report.
    awaiting: VecDeque<UnixStream>,
    /// The seccomp program, read once from the path the requests name.
    bpf: Option<(PathBuf, Vec<u8>)>,
    /// The run's cgroup and the filter its init installed: what a standby
    /// is prepared with (no standby without both).
    run_cgroup: Option<String>,
    run_bpf: Option<Vec<u8>>,
    standby: Option<Standby>,
    /// Standbys that died with no exec handed to them in between: at
    /// [`MAX_STANDBY_DEATHS`] the shim stops forking them (no fork loop
    /// when something in the run kills each one).
    standby_deaths: u32,
}

const MAX_STANDBY_DEATHS: u32 = 3;

/// A forked child waiting in the run for its command (see the module doc).
struct Standby {
    pid: Pid,
    ctl: UnixStream,
}

impl ExecServer {
    /// Binds the run's exec socket (0600): done while the daemon lays the
    /// run out, before the run exists. Nothing connects before `ready`.
    pub fn listen(paths: &RunPaths) -> io::Result<UnixListener> {
        let path = paths.exec_socket();
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path)?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
        listener.set_nonblocking(true)?;
        Ok(listener)
    }

    /// Serves execs on `listener` (see [`ExecServer::listen`]), and moves
    /// the shim's future children into the run's pid namespace (so each
    /// exec needs one fork, not two).
    pub fn bind(
        listener: UnixListener,
        init_pid: i32,
        facts: &crate::spec::RenderedFacts,
    ) -> io::Result<ExecServer> {
        let init = crate::exec::pidfd_open(init_pid)?;
        setns(init.as_fd(), CloneFlags::CLONE_NEWPID).map_err(io::Error::from)?;
        let layout = Layout::detect_once().map_err(io::Error::other)?;
        Ok(ExecServer {
            listener,
            layout,
            init,
            running: Vec::new(),
            awaiting: VecDeque::new(),
            bpf: None,
            run_cgroup: facts.cgroups_path.clone(),
            run_bpf: facts.seccomp_bpf.clone(),
            standby: None,
            standby_deaths: 0,
        })
    }

    pub fn listener_fd(&self) -> BorrowedFd<'_> {
        self.listener.as_fd()
    }

    /// Takes every pending connection and starts its command.
    pub fn accept(&mut self) {
        loop {
            match self.listener.accept() {
                Ok((conn, _)) => self.start(conn),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => return,
            }
        }
    }

    fn start(&mut self, mut conn: UnixStream) {
        let started = conn
            .set_nonblocking(false)
            .and_then(|()| conn.set_read_timeout(Some(Duration::from_secs(2))))
            .and_then(|()| recv_request(&conn))
            .and_then(|(req, frame, fds)| {
                let stdio: [OwnedFd; 3] = fds.try_into().map_err(|_| {
                    io::Error::other("expected 3 descriptors: stdin, stdout, stderr")
                })?;
                self.load_bpf(&req)?;
                if self.hand_to_standby(&req, &frame, &stdio) {
                    return Ok(None);
                }
                self.spawn(&req, stdio).map(Some)
            });
        match started {
            Ok(Some(pid)) => self.running.push((pid, conn)),
            Ok(None) => self.awaiting.push_back(conn),
            Err(e) => {
                let msg = e.to_string().replace('\n', " ");
                let _ = conn.write_all(format!("error {msg}\n").as_bytes());
            }
        }
    }

    /// Forks a standby unless there is one. The shim calls it when it has
    /// nothing else to do.
    pub fn keep_standby(&mut self) {
        if self.standby.is_some()
            || self.standby_deaths >= MAX_STANDBY_DEATHS
            || self.run_cgroup.is_none()
            || self.run_bpf.is_none()
        {
            return;
        }
        let Ok((ours, theirs)) = UnixStream::pair() else {
            return;
        };
        // Each command's first byte comes with its pid (see `vspawn`).
        if nix::sys::socket::setsockopt(&ours, nix::sys::socket::sockopt::PassCred, &true).is_err()
        {
            return;
        }
        // SAFETY: the shim is single-threaded, so the child may run any code.
        match unsafe { fork() } {
            Ok(ForkResult::Child) => {
                drop(ours);
                let code = self.standby_child(theirs);
                // SAFETY: _exit is always safe; nothing of the shim's may run here.
                unsafe { libc::_exit(code) }
            }
            Ok(ForkResult::Parent { child }) => {
                self.standby = Some(Standby {
                    pid: child,
                    ctl: ours,
                })
            }
            Err(e) => eprintln!("sbx shim: fork an exec standby: {e}"),
        }
    }

    /// In the standby: gets ready, then starts one command per request.
    /// Returns when the shim closed the socket, or on an error, with the
    /// exit code.
    fn standby_child(&self, ctl: UnixStream) -> i32 {
        unblock_signals();
        // SAFETY: prctl with integer arguments only.
        unsafe {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            libc::prctl(libc::PR_SET_NAME, c"sbx-exec".as_ptr());
        }
        // (Had the shim died before the prctl, the control socket is at
        // EOF: the wait below ends at once.)
        // What the run's `ps` shows of it, instead of the host's path to sbx.
        rename_cmdline("sbx-exec");
        let (Some(run_cgroup), Some(bpf)) = (&self.run_cgroup, &self.run_bpf) else {
            return 0;
        };
        if let Err(e) = cgroups::join_run_shared(&self.layout, run_cgroup, 0) {
            return crate::exec::fail(EXIT_CANNOT_ENTER, &format!("join run cgroup: {e}"));
        }
        if let Err(e) = setns(self.init.as_fd(), crate::exec::run_namespaces()) {
            return crate::exec::fail(EXIT_CANNOT_ENTER, &format!("enter run namespaces: {e}"));
        }
        // Nothing of the shim's stays open but the control socket (as fd 3,
        // close-on-exec): not the listener, not the pidfd of the init.
        let fd = std::os::fd::IntoRawFd::into_raw_fd(ctl);
        // SAFETY: dup3 and close_range only touch this process's descriptor table.
        unsafe {
            if fd != 3 && libc::dup3(fd, 3, libc::O_CLOEXEC) < 0 {
                return EXIT_CANNOT_ENTER;
            }
            libc::syscall(libc::SYS_close_range, 4u32, u32::MAX, 0u32);
        }
        if let Err(msg) = crate::exec::confine(Some(bpf)) {
            return crate::exec::fail(EXIT_CANNOT_ENTER, &msg);
        }
        // SAFETY: fd 3 is the control socket, owned by nothing else here.
        let ctl = unsafe { UnixStream::from_raw_fd(3) };
        // Until the shim closes the socket (or dies): one command per request.
        while let Ok((req, _, fds)) = recv_request(&ctl) {
            let stdio = [fds[0].as_fd(), fds[1].as_fd(), fds[2].as_fd()];
            let own: Vec<BorrowedFd<'_>> = fds[3..].iter().map(|f| f.as_fd()).collect();
            if let Err(msg) = crate::vspawn::spawn(&req, stdio, &own, ctl.as_raw_fd()) {
                // No process reported for this request: the shim answers it
                // when it reaps this standby.
                crate::exec::say(stdio[2], &msg);
                return EXIT_CANNOT_ENTER;
            }
        }
        0
    }

    /// Gives the request to the standby with the exec's stdio and its own
    /// cgroups' `cgroup.procs`, opened here (the shim is still in the
    /// host's mount namespace). False when there is no standby or it cannot
    /// take this request; the shim forks as before then.
    fn hand_to_standby(&mut self, req: &ExecRequest, frame: &[u8], stdio: &[OwnedFd; 3]) -> bool {
        let Some(standby) = &self.standby else {
            return false;
        };
        let same_run = req
            .cgroup
            .rsplit_once('/')
            .is_some_and(|(run, _)| Some(run) == self.run_cgroup.as_deref());
        let same_filter = match (&req.seccomp_bpf, &self.bpf) {
            (Some(_), Some((_, prog))) => Some(prog) == self.run_bpf.as_ref(),
            _ => false,
        };
        if !same_run || !same_filter {
            return false;
        }
        let Ok(own) = cgroups::open_exec_own(&self.layout, &req.cgroup) else {
            return false;
        };
        let mut fds: Vec<BorrowedFd<'_>> = stdio.iter().map(|f| f.as_fd()).collect();
        fds.extend(own.iter().map(|f| f.as_fd()));
        if send_request(&standby.ctl, frame, &fds).is_ok() {
            self.standby_deaths = 0;
            return true;
        }
        // Broken: reaped like any child; a new one is forked when idle.
        let _ = nix::sys::signal::kill(standby.pid, nix::sys::signal::Signal::SIGKILL);
        false
    }

    /// Gives each command the standby started since last time its
    /// connection, in order, now that its pid is known.
    fn collect_reports(&mut self) {
        let Some(standby) = &self.standby else {
            return;
        };
        while let Some(pid) = fdpass::try_recv_pid(standby.ctl.as_fd()) {
            match self.awaiting.pop_front() {
                Some(conn) => self.running.push((Pid::from_raw(pid), conn)),
                None => eprintln!("sbx shim: exec standby reported pid {pid} for no exec"),
            }
        }
    }

    /// Reads the request's seccomp program on the host's side, once per path.
    fn load_bpf(&mut self, req: &ExecRequest) -> io::Result<()> {
        if let Some(p) = &req.seccomp_bpf {
            if self.bpf.as_ref().is_none_or(|(have, _)| have != p) {
                self.bpf = Some((p.clone(), std::fs::read(p)?));
            }
        }
        Ok(())
    }

    fn spawn(&self, req: &ExecRequest, stdio: [OwnedFd; 3]) -> io::Result<Pid> {
        let bpf = req
            .seccomp_bpf
            .as_ref()
            .and(self.bpf.as_ref())
            .map(|(_, prog)| prog.as_slice());
        // SAFETY: the shim is single-threaded, so the child may run any code.
        match unsafe { fork() }.map_err(io::Error::from)? {
            ForkResult::Child => {
                let code = self.child(req, &stdio, bpf);
                // SAFETY: _exit is always safe; nothing of the shim's may run here.
                unsafe { libc::_exit(code) }
            }
            ForkResult::Parent { child } => Ok(child),
        }
    }

    /// In the forked child: returns only on error, with the exit code.
    fn child(&self, req: &ExecRequest, stdio: &[OwnedFd; 3], bpf: Option<&[u8]>) -> i32 {
        if !install_stdio(stdio) {
            return EXIT_CANNOT_ENTER;
        }
        // Nothing else of the shim's may reach the command (libcontainer
        // leaves descriptors without close-on-exec).
        // SAFETY: close_range only marks descriptors of this process.
        unsafe {
            libc::syscall(
                libc::SYS_close_range,
                3u32,
                u32::MAX,
                libc::CLOSE_RANGE_CLOEXEC,
            );
        }
        unblock_signals();
        // "0" is the writer itself, whatever pid namespace it is in.
        if let Err(e) = cgroups::join_exec(&self.layout, &req.cgroup, 0) {
            return crate::exec::fail(EXIT_CANNOT_ENTER, &format!("join exec cgroup: {e}"));
        }
        if let Err(e) = setns(self.init.as_fd(), crate::exec::run_namespaces()) {
            return crate::exec::fail(EXIT_CANNOT_ENTER, &format!("enter run namespaces: {e}"));
        }
        crate::exec::child(req, bpf)
    }

    /// A child of the shim was reaped: answers its connection if it was an
    /// exec. `code` is the exit status, or 128+signal.
    pub fn reaped(&mut self, pid: Pid, code: i32) {
        // A command may end before its pid is read: read them all first.
        self.collect_reports();
        if self.standby.as_ref().is_some_and(|s| s.pid == pid) {
            // Died (killed by the run's own root, say). Execs it had not
            // started yet are answered as unstartable.
            self.standby = None;
            for mut conn in self.awaiting.drain(..) {
                let _ = conn.write_all(b"error the run's exec standby ended\n");
            }
            self.standby_deaths += 1;
            if self.standby_deaths == MAX_STANDBY_DEATHS {
                eprintln!("sbx shim: {MAX_STANDBY_DEATHS} exec standbys died in a row; execs fork from now on");
            }
            return;
        }
        if let Some(i) = self.running.iter().position(|(p, _)| *p == pid) {
            let (_, mut conn) = self.running.swap_remove(i);
            // One write: the daemon wakes once, with the whole line.
            let _ = conn.write_all(format!("exit {code}\n").as_bytes());
        }
    }
}

/// Overwrites this process's argv strings (what /proc/<pid>/cmdline shows)
/// with `name`, in place: the standby is forked from the shim, whose argv
/// names the sbx binary's path on the host. Best effort.
fn rename_cmdline(name: &str) {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return;
    };
    // Fields after the command name, which may hold spaces: arg_start and
    // arg_end are fields 48 and 49, i.e. 46 and 47 after it.
    let Some((_, rest)) = stat.rsplit_once(") ") else {
        return;
    };
    let fields: Vec<&str> = rest.split(' ').collect();
    let (Some(Ok(start)), Some(Ok(end))) = (
        fields.get(45).map(|f| f.parse::<usize>()),
        fields.get(46).map(|f| f.parse::<usize>()),
    ) else {
        return;
    };
    if start == 0 || end <= start || end - start <= name.len() {
        return;
    }
    // SAFETY: [arg_start, arg_end) is this process's own argv area, mapped
    // and writable (the kernel put it on our stack); nothing in this
    // single-threaded child reads argv again.
    unsafe {
        std::ptr::write_bytes(start as *mut u8, 0, end - start);
        std::ptr::copy_nonoverlapping(name.as_ptr(), start as *mut u8, name.len());
    }
}

/// The exec's stdin, stdout and stderr as 0, 1 and 2.
fn install_stdio(stdio: &[OwnedFd; 3]) -> bool {
    stdio
        .iter()
        .enumerate()
        .all(|(target, fd)| nix::unistd::dup2(fd.as_raw_fd(), target as RawFd).is_ok())
}

/// The shim takes its signals through a signalfd; its children must not
/// inherit that mask.
fn unblock_signals() {
    let _ = nix::sys::signal::sigprocmask(SigmaskHow::SIG_SETMASK, Some(&SigSet::empty()), None);
}

/// Reads one request: parsed, its frame as it came (passed on to a standby
/// as is), and its descriptors: stdin, stdout and stderr, then (from the
/// shim to a standby) the exec's own `cgroup.procs` files.
fn recv_request(conn: &UnixStream) -> io::Result<(ExecRequest, Vec<u8>, Vec<OwnedFd>)> {
    let mut buf = vec![0u8; 64 * 1024];
    let (n, fds) = fdpass::recv_with_fds(conn.as_fd(), &mut buf)?;
    if n == 0 {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    if fds.len() < 3 {
        return Err(io::Error::other(
            "expected stdin, stdout and stderr descriptors",
        ));
    }
    if n < 4 {
        return Err(io::Error::other("short exec request"));
    }
    let len = u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
    if len > MAX_REQUEST {
        return Err(io::Error::other("exec request too large"));
    }
    if buf.len() < 4 + len {
        buf.resize(4 + len, 0);
    }
    if n < 4 + len {
        (&*conn).read_exact(&mut buf[n..4 + len])?;
    }
    buf.truncate(4 + len);
    let req = serde_json::from_slice(&buf[4..]).map_err(io::Error::other)?;
    Ok((req, buf, fds))
}

/// Daemon side: sends `request` (already framed) with the command's stdio.
pub fn send_request(conn: &UnixStream, request: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    let sent = fdpass::send_with_fds(conn.as_fd(), request, fds)?;
    if sent < request.len() {
        (&*conn).write_all(&request[sent..])?;
    }
    Ok(())
}

/// Parses the shim's answer line.
pub fn parse_answer(line: &str) -> Result<i32, String> {
    let line = line.trim_end();
    if let Some(code) = line.strip_prefix("exit ") {
        return code
            .parse()
            .map_err(|_| format!("malformed answer {line:?}"));
    }
    match line.strip_prefix("error ") {
        Some(msg) => Err(msg.to_string()),
        None if line.is_empty() => Err("the run's shim closed the exec connection".into()),
        None => Err(format!("malformed answer {line:?}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_parse() {
        assert_eq!(parse_answer("exit 0\n"), Ok(0));
        assert_eq!(parse_answer("exit 137"), Ok(137));
        assert_eq!(
            parse_answer("error no such cgroup\n"),
            Err("no such cgroup".into())
        );
        assert!(parse_answer("").is_err());
        assert!(parse_answer("exit x").is_err());
    }

    #[test]
    fn request_and_descriptors_cross_the_socket() {
        let (a, b) = UnixStream::pair().expect("pair");
        let req = ExecRequest {
            init_pid: 1,
            init_start: 2,
            cgroup: "/sbx/r/exec-1".into(),
            argv: vec!["echo".into(), "x".repeat(100_000)],
            env: vec!["A=1".into()],
            cwd: "/work".into(),
            uid: 1000,
            gid: 1000,
            seccomp_bpf: None,
        };
        let bytes = crate::exec::encode_request(&req);
        let (r, w) = nix::unistd::pipe().expect("pipe");
        let w2 = w.try_clone().expect("dup");
        let sender = std::thread::spawn(move || {
            send_request(&a, &bytes, &[w2.as_fd(), w2.as_fd(), w2.as_fd()]).expect("send");
        });
        let (got, frame, stdio) = recv_request(&b).expect("recv");
        sender.join().expect("join");
        assert_eq!(
            frame,
            crate::exec::encode_request(&req),
            "the frame as sent"
        );
        assert_eq!(got.argv, req.argv);
        assert_eq!(got.cgroup, req.cgroup);
        // The received descriptor is the pipe's write end.
        drop(w);
        nix::unistd::write(&stdio[1], b"hi").expect("write");
        drop(stdio);
        let mut out = String::new();
        std::fs::File::from(r)
            .read_to_string(&mut out)
            .expect("read");
        assert_eq!(out, "hi");
    }
}
