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
