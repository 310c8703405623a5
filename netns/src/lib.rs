//! Per-run network namespaces. This slice has the `none` tier: a fresh
//! network namespace with only loopback, brought up here because the run
//! itself holds no `CAP_NET_ADMIN`.

#![allow(unsafe_code)]

pub mod firewall;
pub mod ipam;
pub mod links;
pub mod names;

use std::fs::File;
use std::os::fd::AsRawFd;

use nix::sched::{setns, CloneFlags};

#[derive(Debug, thiserror::Error)]
pub enum NetnsError {
    #[error("open network namespace of pid {pid}")]
    Open {
        pid: i32,
        #[source]
        source: std::io::Error,
    },
    #[error("enter network namespace of pid {pid}")]
    Enter {
        pid: i32,
        #[source]
        source: nix::Error,
    },
    #[error("return to the original network namespace")]
    Return(#[source] nix::Error),
    #[error("set loopback up")]
    Loopback(#[source] std::io::Error),
}

/// Sets `lo` up inside the network namespace of `pid`. Changes the calling
/// thread's namespace for the duration, so call it only from a
/// single-threaded process (the shim).
pub fn loopback_up_in(pid: i32) -> Result<(), NetnsError> {
    let own = File::open("/proc/thread-self/ns/net")
        .map_err(|source| NetnsError::Open { pid: 0, source })?;
    let target = File::open(format!("/proc/{pid}/ns/net"))
        .map_err(|source| NetnsError::Open { pid, source })?;
    setns(&target, CloneFlags::CLONE_NEWNET).map_err(|source| NetnsError::Enter { pid, source })?;
    let result = set_up("lo");
    setns(&own, CloneFlags::CLONE_NEWNET).map_err(NetnsError::Return)?;
    result.map_err(NetnsError::Loopback)
}

/// Creates a network namespace pinned by a bind mount on `path` (a new
/// empty file), with loopback up, IPv6 and router advertisements off and
/// unprivileged ping allowed. The work happens on a thread of its own (the
/// only one whose namespace changes), so any process may call it.
pub fn create_pinned(path: &std::path::Path) -> Result<(), NetnsError> {
    pin_new(
        path,
        &[
            ("/proc/sys/net/ipv6/conf/all/disable_ipv6", "1"),
            ("/proc/sys/net/ipv6/conf/default/disable_ipv6", "1"),
            ("/proc/sys/net/ipv6/conf/all/accept_ra", "0"),
            ("/proc/sys/net/ipv6/conf/default/accept_ra", "0"),
            ("/proc/sys/net/ipv4/ping_group_range", "0 2147483647"),
        ],
    )
}

/// Creates a network namespace pinned on `path` with loopback up and the
/// kernel's defaults otherwise: what a `none` run gets, made ahead of time.
pub fn create_pinned_loopback_only(path: &std::path::Path) -> Result<(), NetnsError> {
    pin_new(path, &[])
}

fn pin_new(path: &std::path::Path, sysctls: &'static [(&str, &str)]) -> Result<(), NetnsError> {
    let path = path.to_path_buf();
    let worker = std::thread::spawn(move || -> Result<(), NetnsError> {
        nix::sched::unshare(CloneFlags::CLONE_NEWNET)
            .map_err(|source| NetnsError::Enter { pid: 0, source })?;
        for &(p, v) in sysctls {
            links::sysctl(p, v)
                .map_err(|e| NetnsError::Loopback(std::io::Error::other(e.to_string())))?;
        }
        set_up("lo").map_err(NetnsError::Loopback)?;
        std::fs::File::create(&path).map_err(|source| NetnsError::Open { pid: 0, source })?;
        nix::mount::mount(
            Some("/proc/thread-self/ns/net"),
            &path,
            None::<&str>,
            nix::mount::MsFlags::MS_BIND,
            None::<&str>,
        )
        .map_err(|source| NetnsError::Enter { pid: 0, source })
    });
    match worker.join() {
        Ok(r) => r,
        Err(_) => Err(NetnsError::Loopback(std::io::Error::other(
            "namespace thread panicked",
        ))),
    }
}

/// Releases a pinned namespace: detaches the bind mount and removes the
/// file. Once no process is in it either, the kernel destroys it with its
/// links. Missing is fine.
pub fn remove_pinned(path: &std::path::Path) -> Result<(), NetnsError> {
    match nix::mount::umount2(path, nix::mount::MntFlags::MNT_DETACH) {
        Ok(()) | Err(nix::errno::Errno::EINVAL) | Err(nix::errno::Errno::ENOENT) => {}
        Err(source) => return Err(NetnsError::Enter { pid: 0, source }),
    }
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(NetnsError::Open { pid: 0, source }),
    }
}

fn set_up(name: &str) -> std::io::Result<()> {
    let sock =
        std::net::UdpSocket::bind("0.0.0.0:0").or_else(|_| std::net::UdpSocket::bind("[::]:0"))?;
    // SAFETY: ifreq is plain old data; zeroed is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (i, b) in name.bytes().enumerate().take(libc::IFNAMSIZ - 1) {
        req.ifr_name[i] = b as libc::c_char;
    }
    // SAFETY: valid socket fd, `req` is a properly sized ifreq that outlives the call.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS, &mut req) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: SIOCGIFFLAGS filled the flags member of the union.
    unsafe { req.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short };
    // SAFETY: as above; the kernel reads the flags we set.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS, &req) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}
