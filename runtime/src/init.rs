//! PID 1 inside every run: reaps orphans, exits on SIGTERM/SIGINT/SIGHUP.
//! It is the only place in sbx that waits on any child (`waitpid(-1)`),
//! because reaping re-parented orphans is exactly what a PID 1 is for.

use nix::sys::signal::{SigSet, SigmaskHow, Signal};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;

pub fn init_main() -> ! {
    let all = SigSet::all();
    let _ = nix::sys::signal::sigprocmask(SigmaskHow::SIG_BLOCK, Some(&all), None);
    loop {
        match all.wait() {
            Ok(Signal::SIGCHLD) => loop {
                match waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)) {
                    Ok(WaitStatus::StillAlive) | Err(_) => break,
                    Ok(_) => continue,
                }
            },
            Ok(Signal::SIGTERM | Signal::SIGINT | Signal::SIGHUP | Signal::SIGQUIT) => {
                std::process::exit(0)
            }
            _ => {}
        }
    }
}
