//! Running one command in a run: hand it to the run's shim (or spawn the
//! exec helper), stream its output,
//! enforce the timeout by killing the exec's cgroup from outside, and decide
//! the end by the process, not by pipe EOF (a `sleep 30 &` holds the pipe).

use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;

use sbx_runtime::exec::{encode_request, ExecRequest};

use super::model::ExecPlan;
use super::sandbox::Host;
use super::ExecTicket;

/// How long output is still collected after the command's process ended.
const DRAIN_DEADLINE: Duration = Duration::from_millis(250);

#[derive(Debug)]
pub enum ExecEvent {
    Stdout(Bytes),
    Stderr(Bytes),
    Exit(ExitInfo),
}

#[derive(Debug, Clone, Copy, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ExitInfo {
    pub exit_code: i32,
    pub timed_out: bool,
    pub duration_ms: u64,
}

fn merge_env(base: &[(String, String)], extra: &[(String, String)]) -> Vec<String> {
    let mut out: Vec<(String, String)> = base.to_vec();
    for (k, v) in extra {
        match out.iter_mut().find(|(bk, _)| bk == k) {
            Some(slot) => slot.1 = v.clone(),
            None => out.push((k.clone(), v.clone())),
        }
    }
    out.into_iter().map(|(k, v)| format!("{k}={v}")).collect()
}

async fn pump(
    mut r: impl tokio::io::AsyncRead + Unpin,
    tx: mpsc::Sender<ExecEvent>,
    out: fn(Bytes) -> ExecEvent,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match r.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => {
                if tx
                    .send(out(Bytes::copy_from_slice(&buf[..n])))
                    .await
                    .is_err()
                {
                    // Nobody listens any more; keep draining so the command never blocks.
                    continue;
                }
            }
        }
    }
}

/// How the command's end is learned: from the run's shim, which forked it
/// (the usual way), or from a spawned `sbx exec-helper` (runs whose shim
/// has no exec socket, e.g. started by an older sbx, or whose shim died).
enum Waiter {
    Shim(tokio::io::BufReader<tokio::net::UnixStream>),
    Helper(tokio::process::Child),
}

impl Waiter {
    /// The command's exit code (128+signal when killed).
    async fn wait(&mut self) -> std::io::Result<Result<i32, String>> {
        match self {
            Waiter::Shim(conn) => {
                let mut line = String::new();
                conn.read_line(&mut line).await?;
                Ok(sbx_runtime::execsrv::parse_answer(&line))
            }
            Waiter::Helper(child) => {
                use std::os::unix::process::ExitStatusExt;
                let status = child.wait().await?;
                Ok(Ok(status
                    .code()
                    .unwrap_or_else(|| 128 + status.signal().unwrap_or(0))))
            }
        }
    }
}

type Stdio = (
    Box<dyn tokio::io::AsyncWrite + Send + Unpin>,
    Box<dyn tokio::io::AsyncRead + Send + Unpin>,
    Box<dyn tokio::io::AsyncRead + Send + Unpin>,
);

/// Hands the request to the run's shim; `None` when the shim cannot take it.
fn start_in_shim(socket: &std::path::Path, header: &[u8]) -> Option<(Waiter, Stdio)> {
    use std::os::fd::AsFd;
    use tokio::net::unix::pipe;
    let conn = std::os::unix::net::UnixStream::connect(socket).ok()?;
    let flags = nix::fcntl::OFlag::O_CLOEXEC;
    let (in_r, in_w) = nix::unistd::pipe2(flags).ok()?;
    let (out_r, out_w) = nix::unistd::pipe2(flags).ok()?;
    let (err_r, err_w) = nix::unistd::pipe2(flags).ok()?;
    sbx_runtime::execsrv::send_request(
        &conn,
        header,
        &[in_r.as_fd(), out_w.as_fd(), err_w.as_fd()],
    )
    .ok()?;
    // The command holds the other ends now.
    drop((in_r, out_w, err_w));
    conn.set_nonblocking(true).ok()?;
    let conn = tokio::net::UnixStream::from_std(conn).ok()?;
    let stdio: Stdio = (
        Box::new(pipe::Sender::from_owned_fd(in_w).ok()?),
        Box::new(pipe::Receiver::from_owned_fd(out_r).ok()?),
        Box::new(pipe::Receiver::from_owned_fd(err_r).ok()?),
    );
    Some((Waiter::Shim(tokio::io::BufReader::new(conn)), stdio))
}

fn start_helper(host: &Host, id: &str) -> std::io::Result<(Waiter, Stdio)> {
    let mut child = tokio::process::Command::new(&host.self_exe)
        .arg("exec-helper")
        .arg(id)
        .env_clear()
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    let none = |what| std::io::Error::other(format!("no {what}"));
    let stdio: Stdio = (
        Box::new(child.stdin.take().ok_or_else(|| none("stdin"))?),
        Box::new(child.stdout.take().ok_or_else(|| none("stdout"))?),
        Box::new(child.stderr.take().ok_or_else(|| none("stderr"))?),
    );
    Ok((Waiter::Helper(child), stdio))
}

/// Runs the command; output events go to `tx`; returns how it ended.
pub async fn run(
    host: &Host,
    ticket: &ExecTicket,
    plan: ExecPlan,
    tx: mpsc::Sender<ExecEvent>,
) -> std::io::Result<ExitInfo> {
    let req = ExecRequest {
        init_pid: ticket.init_pid,
        init_start: ticket.init_start,
        cgroup: ticket.cgroup.clone(),
        argv: plan.argv,
        env: merge_env(&ticket.base_env, &plan.env),
        cwd: plan.cwd.unwrap_or_else(|| ticket.workdir.clone()),
        uid: ticket.uid,
        gid: ticket.gid,
        seccomp_bpf: host.seccomp.as_ref().map(|s| s.path.clone()),
    };
    let started = Instant::now();
    let header = encode_request(&req);
    let socket = host.paths(&ticket.id).exec_socket();
    let (mut waiter, (mut stdin, stdout, stderr), header) = match start_in_shim(&socket, &header) {
        Some((w, s)) => (w, s, Vec::new()),
        None => {
            let (w, s) = start_helper(host, &ticket.id)?;
            (w, s, header)
        }
    };
    let input = plan.stdin;
    let feeder = tokio::spawn(async move {
        if stdin.write_all(&header).await.is_ok() && !input.is_empty() {
            let _ = stdin.write_all(&input).await;
        }
        drop(stdin);
    });
    let mut out_task = tokio::spawn(pump(stdout, tx.clone(), ExecEvent::Stdout));
    let mut err_task = tokio::spawn(pump(stderr, tx.clone(), ExecEvent::Stderr));

    let timeout = Duration::from_secs(plan.timeout_secs);
    let (ended, timed_out) = match tokio::time::timeout(timeout, waiter.wait()).await {
        Ok(r) => (r?, false),
        Err(_) => {
            let (layout, cg) = (host.layout.clone(), ticket.cgroup.clone());
            let killed =
                tokio::task::spawn_blocking(move || sbx_runtime::cgroups::kill_tree(&layout, &cg))
                    .await;
            tracing::info!(run = %ticket.id, killed = ?killed.ok().and_then(Result::ok), "exec timed out");
            if let Waiter::Helper(child) = &mut waiter {
                let _ = child.start_kill();
            }
            let after = tokio::time::timeout(Duration::from_secs(5), waiter.wait()).await;
            (after.unwrap_or(Ok(Ok(124)))?, true)
        }
    };
    feeder.abort();
    let code = match ended {
        Ok(code) => code,
        Err(msg) => {
            // The shim could not start the command: say so as the helper would.
            let _ = tx
                .send(ExecEvent::Stderr(Bytes::from(format!("sbx: {msg}\n"))))
                .await;
            sbx_runtime::exec::EXIT_CANNOT_ENTER
        }
    };
    // The command's process is gone; give the pipes a bounded moment to drain.
    // A background process may hold the pipes open for ever; stop there.
    let drain = async {
        let _ = (&mut out_task).await;
        let _ = (&mut err_task).await;
    };
    let _ = tokio::time::timeout(DRAIN_DEADLINE, drain).await;
    out_task.abort();
    err_task.abort();
    let exit_code = if timed_out { 124 } else { code };
    let (layout, cg) = (host.layout.clone(), ticket.cgroup.clone());
    tokio::task::spawn_blocking(move || sbx_runtime::cgroups::remove_if_empty(&layout, &cg));
    Ok(ExitInfo {
        exit_code,
        timed_out,
        duration_ms: started.elapsed().as_millis() as u64,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exec_env_overrides_base_env() {
        let base = vec![
            ("PATH".to_string(), "/bin".to_string()),
            ("A".to_string(), "1".to_string()),
        ];
        let extra = vec![
            ("A".to_string(), "2".to_string()),
            ("B".to_string(), "3".to_string()),
        ];
        assert_eq!(merge_env(&base, &extra), vec!["PATH=/bin", "A=2", "B=3"]);
    }
}
