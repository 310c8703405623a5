//! The shim: one single-threaded process per run, forked from the daemon's
//! zygote (`sbx shim --zygote`). It creates the run with
//! libcontainer (which clones with raw syscalls and must not run inside the
//! multi-threaded daemon), is the subreaper and parent of the run's init,
//! records its exit, and outlives daemon restarts.
//!
//! Protocol with the daemon: the shim prints one line on its ready pipe —
//! `ready <state as JSON>` or `error <message>` — then detaches stdout. It then
//! serves execs on `exec.sock` (see `execsrv`). SIGTERM asks it to kill the
//! run; it exits when the run's init is gone, leaving `exit` (the init's
//! wait status) in the run directory. Teardown of cgroups
//! and mounts belongs to the daemon, so it also works when a shim died.

use std::fs::File;
use std::io::Write;
use std::os::fd::OwnedFd;
use std::path::PathBuf;

use libcontainer::container::builder::ContainerBuilder;
use libcontainer::notify_socket::{NotifySocket, NOTIFY_FILE};
use libcontainer::syscall::syscall::SyscallType;
use std::os::fd::AsFd;

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::signal::{kill, SigSet, SigmaskHow, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;

use crate::execsrv::ExecServer;
use crate::{start_time, write_atomic, RunPaths, ShimState};

#[derive(Debug, thiserror::Error)]
pub enum ShimError {
    #[error("become subreaper")]
    Subreaper(#[source] nix::Error),
    #[error("open /dev/null")]
    DevNull(#[source] std::io::Error),
    #[error("create container")]
    Create(#[source] libcontainer::error::LibcontainerError),
    #[error("start container")]
    Start(#[source] libcontainer::error::LibcontainerError),
    #[error("container has no init pid")]
    NoPid,
    #[error("bring up loopback")]
    Loopback(#[source] sbx_netns::NetnsError),
    #[error("write shim state {path}")]
    State {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

fn dev_null() -> Result<OwnedFd, ShimError> {
    Ok(File::options()
        .read(true)
        .write(true)
        .open("/dev/null")
        .map_err(ShimError::DevNull)?
        .into())
}

/// What the shim needs from the bundle's `config.json`, read once.
fn read_facts(bundle: &std::path::Path) -> crate::spec::RenderedFacts {
    std::fs::read(bundle.join("config.json"))
        .ok()
        .and_then(|text| serde_json::from_slice::<serde_json::Value>(&text).ok())
        .map(|v| crate::spec::rendered_facts(&v))
        .unwrap_or_default()
}

fn create(
    paths: &RunPaths,
    id: &str,
    facts: &crate::spec::RenderedFacts,
) -> Result<ShimState, ShimError> {
    nix::sys::prctl::set_child_subreaper(true).map_err(ShimError::Subreaper)?;
    let container = ContainerBuilder::new(id.to_string(), SyscallType::Linux)
        .with_root_path(paths.container_root())
        .map_err(ShimError::Create)?
        .with_stdin(dev_null()?)
        .with_stdout(dev_null()?)
        .with_stderr(dev_null()?)
        .as_init(paths.bundle())
        .with_systemd(false)
        .with_detach(true)
        .build()
        .map_err(ShimError::Create)?;
    let init = container.pid().ok_or(ShimError::NoPid)?;
    // A namespace of the daemon's pool has loopback up already; one
    // libcontainer made for this run does not.
    if !facts.joins_network_namespace {
        sbx_netns::loopback_up_in(init.as_raw()).map_err(ShimError::Loopback)?;
    }
    // The init waits on libcontainer's notify socket: tell it to go.
    // `Container::start` would first re-read the init's stat and the saved
    // config, and after rewrite state.json as running — bookkeeping sbx
    // never reads (it keeps its own state, and its specs have no hooks) —
    // with the init waiting or the ready line behind it.
    NotifySocket::new(container.root.join(NOTIFY_FILE))
        .notify_container_start()
        .map_err(|e| ShimError::Start(e.into()))?;
    let me = std::process::id() as i32;
    Ok(ShimState {
        shim_pid: me,
        shim_start: start_time(me).unwrap_or(0),
        init_pid: init.as_raw(),
        init_start: start_time(init.as_raw()).unwrap_or(0),
    })
}

/// Records the shim's state in the run directory (`shim.json`), for a
/// daemon that restarts without it in its database and for teardown.
fn record(paths: &RunPaths, state: &ShimState) -> Result<(), ShimError> {
    let path = paths.shim_state();
    let body = serde_json::to_vec(state).map_err(|e| ShimError::State {
        path: path.clone(),
        source: std::io::Error::other(e),
    })?;
    write_atomic(&path, &body).map_err(|source| ShimError::State { path, source })
}

/// Entry point of `sbx shim --zygote`: the one process, per daemon, that
/// every shim is forked from. Its stdin is a SOCK_SEQPACKET socket to the
/// daemon; each message is `<run-dir>\t<id>\n` with one descriptor
/// attached, the write end of the pipe the new shim reports `ready` on.
/// Forking a started process instead of starting one saves the ~2.5 ms of
/// loading and relocating this 28 MB binary per create, and the relocated
/// pages (~0.8 MiB of `.data.rel.ro` and `.got`, read-only after startup)
/// stay shared with the zygote instead of being copied into every shim.
/// Exits when the daemon goes (end of stream).
#[allow(unsafe_code)]
pub fn zygote_main() -> i32 {
    // Shims are reaped by the kernel; each puts SIGCHLD back (shim_main).
    // SAFETY: SIG_IGN installs no handler; nothing of ours runs on a signal.
    let _ =
        unsafe { nix::sys::signal::signal(Signal::SIGCHLD, nix::sys::signal::SigHandler::SigIgn) };
    // Once for every shim forked from here, and for libcontainer's
    // processes forked from those (see `Layout::detect_once` and the
    // libcgroups patch's `read_mountinfo`).
    if let Ok(layout) = crate::cgroups::Layout::detect_once() {
        if !layout.is_v2() {
            let _ = libcgroups::v1::util::get_subsystem_mount_point(
                &libcgroups::v1::ControllerType::CpuSet,
            );
        }
    }
    let mut buf = vec![0u8; 8192];
    loop {
        // SAFETY: fd 0 is the daemon's socket for the life of the zygote.
        let sock = unsafe { std::os::fd::BorrowedFd::borrow_raw(0) };
        let (n, fds) = match crate::fdpass::recv_with_fds(sock, &mut buf) {
            Ok((0, _)) => return 0,
            Ok(r) => r,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => return 0,
        };
        let mut fds = fds.into_iter();
        let (ready, go) = (fds.next(), fds.next());
        let line = String::from_utf8_lossy(&buf[..n]).into_owned();
        let (Some(ready), Some((dir, id))) = (ready, line.trim_end().split_once('\t')) else {
            eprintln!("sbx shim zygote: malformed request");
            continue;
        };
        // SAFETY: this process is single-threaded; the child runs any code.
        match unsafe { nix::unistd::fork() } {
            Ok(nix::unistd::ForkResult::Child) => {
                // The run's ready pipe becomes stdout; the daemon's socket goes.
                let _ = nix::unistd::dup2(std::os::fd::AsRawFd::as_raw_fd(&ready), 1);
                drop(ready);
                if let Ok(null) = dev_null() {
                    let _ = nix::unistd::dup2(std::os::fd::AsRawFd::as_raw_fd(&null), 0);
                }
                let code = assigned(PathBuf::from(dir), id, go);
                std::process::exit(code);
            }
            Ok(nix::unistd::ForkResult::Parent { .. }) => drop((ready, go)),
            Err(e) => {
                let mut f = File::from(ready);
                let _ = writeln!(f, "error fork a shim: {e}");
            }
        }
    }
}

/// A forked shim takes its run: the run directory as cwd names the run it
/// serves (see the daemon's `find_shims`), the run's log becomes stderr.
fn assigned(run_dir: PathBuf, id: &str, go: Option<OwnedFd>) -> i32 {
    if let Err(e) = std::env::set_current_dir(&run_dir) {
        let _ = writeln!(std::io::stdout(), "error enter {}: {e}", run_dir.display());
        return 1;
    }
    let log = File::options()
        .create(true)
        .append(true)
        .open(RunPaths::new(run_dir.clone()).shim_log());
    if let Ok(log) = log {
        let _ = nix::unistd::dup2(std::os::fd::AsRawFd::as_raw_fd(&log), 2);
    }
    shim_main(run_dir, id, go)
}

/// A shim's life once forked for its run; returns its exit code.
fn shim_main(run_dir: PathBuf, id: &str, go: Option<OwnedFd>) -> i32 {
    let _ = nix::unistd::setsid();
    // The run's init inherits the shim's dispositions (see there).
    crate::exec::reset_signal_dispositions();
    let all = SigSet::all();
    // Signals are taken synchronously below; nothing else runs here.
    let _ = nix::sys::signal::sigprocmask(SigmaskHow::SIG_BLOCK, Some(&all), None);
    let paths = RunPaths::new(run_dir);
    let mut stdout = std::io::stdout();
    let mut mask = SigSet::empty();
    for sig in [Signal::SIGCHLD, Signal::SIGTERM, Signal::SIGINT] {
        mask.add(sig);
    }
    let sfd = match SignalFd::with_flags(&mask, SfdFlags::SFD_CLOEXEC | SfdFlags::SFD_NONBLOCK) {
        Ok(f) => f,
        Err(e) => {
            let _ = writeln!(stdout, "error signalfd: {e}");
            return 1;
        }
    };
    let listener = ExecServer::listen(&paths)
        .map_err(|e| eprintln!("sbx shim: exec socket: {e}"))
        .ok();
    // The daemon lays out the run's root and bundle meanwhile; `g` when it
    // is done. Anything else (the pipe closed) means the create was given up.
    if let Some(go) = go {
        let mut b = [0u8; 1];
        if !matches!(nix::unistd::read(std::os::fd::AsRawFd::as_raw_fd(&go), &mut b), Ok(1) if b[0] == b'g')
        {
            return 1;
        }
    }
    let facts = read_facts(&paths.bundle());
    let state = match create(&paths, id, &facts) {
        Ok(s) => s,
        Err(e) => {
            let mut msg = e.to_string();
            let mut src = std::error::Error::source(&e);
            while let Some(s) = src {
                msg.push_str(": ");
                msg.push_str(&s.to_string());
                src = s.source();
            }
            let _ = writeln!(stdout, "error {}", msg.replace('\n', " "));
            return 1;
        }
    };
    // Serving before "ready", so the daemon can use it for the first exec.
    // A run without it still works through `sbx exec-helper`.
    let mut execs = match listener.map(|l| ExecServer::bind(l, state.init_pid, &facts)) {
        Some(Ok(s)) => Some(s),
        Some(Err(e)) => {
            eprintln!("sbx shim: exec server: {e}");
            None
        }
        None => None,
    };
    // The state goes with "ready" (the daemon keeps it in its database);
    // the file is written after, off the create's path (an ext4 create
    // and rename here).
    let line = serde_json::to_string(&state).unwrap_or_default();
    let _ = writeln!(stdout, "ready {line}");
    let _ = stdout.flush();
    // The first exec's standby before the file: the exec comes sooner.
    if let Some(s) = &mut execs {
        s.keep_standby();
    }
    if let Err(e) = record(&paths, &state) {
        eprintln!("sbx shim: {e}");
    }
    if let Ok(null) = dev_null() {
        let _ = nix::unistd::dup2(std::os::fd::AsRawFd::as_raw_fd(&null), 1);
    }
    let init = Pid::from_raw(state.init_pid);
    loop {
        // Off the exec's path: the next exec finds a process already in
        // the run, confined, waiting for its command.
        if let Some(s) = &mut execs {
            s.keep_standby();
        }
        let mut fds = vec![PollFd::new(sfd.as_fd(), PollFlags::POLLIN)];
        if let Some(s) = &execs {
            fds.push(PollFd::new(s.listener_fd(), PollFlags::POLLIN));
        }
        match poll(&mut fds, PollTimeout::NONE) {
            Ok(_) => {}
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => {
                // Not seen; poll over two valid descriptors has no other
                // failure to wait out.
                eprintln!("sbx shim: poll: {e}");
                std::thread::sleep(std::time::Duration::from_millis(10));
                continue;
            }
        }
        let accept = fds
            .get(1)
            .and_then(|f| f.revents())
            .is_some_and(|r| r.contains(PollFlags::POLLIN));
        drop(fds);
        if accept {
            if let Some(s) = &mut execs {
                s.accept();
            }
        }
        while let Ok(Some(info)) = sfd.read_signal() {
            let signo = info.ssi_signo as i32;
            if signo == Signal::SIGTERM as i32 || signo == Signal::SIGINT as i32 {
                let _ = kill(init, Signal::SIGKILL);
            }
        }
        // Reap everything that ended: execs are answered; the init's end is
        // the shim's (the kernel ends the init only once every other process
        // of its pid namespace has been reaped, execs included).
        loop {
            let (pid, status) = match waitpid(None::<Pid>, Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::Exited(pid, code)) => (pid, code),
                Ok(WaitStatus::Signaled(pid, sig, _)) => (pid, 128 + sig as i32),
                Ok(WaitStatus::StillAlive) => break,
                Ok(_) => continue,
                Err(nix::errno::Errno::EINTR) => continue,
                Err(nix::errno::Errno::ECHILD) => {
                    let _ = write_atomic(&paths.exit_file(), b"gone");
                    return 0;
                }
                Err(_) => break,
            };
            if pid == init {
                let _ = write_atomic(&paths.exit_file(), format!("exited {status}").as_bytes());
                return 0;
            }
            if let Some(s) = &mut execs {
                s.reaped(pid, status);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spec_that_joins_a_network_namespace_is_recognised() {
        let d = tempfile::tempdir().expect("tmp");
        let write = |v: serde_json::Value| {
            std::fs::write(d.path().join("config.json"), v.to_string()).expect("write")
        };
        write(serde_json::json!({"linux": {"namespaces": [
            {"type": "pid"}, {"type": "network", "path": "/run/sbx/netns/x"}]}}));
        assert!(read_facts(d.path()).joins_network_namespace);
        write(serde_json::json!({"linux": {"namespaces": [{"type": "network"}]}}));
        assert!(!read_facts(d.path()).joins_network_namespace);
        std::fs::remove_file(d.path().join("config.json")).expect("rm");
        assert!(!read_facts(d.path()).joins_network_namespace);
    }
}
