//! Descriptors over Unix sockets (SCM_RIGHTS): the daemon hands a shim an
//! exec's stdio, and the zygote a new shim's ready pipe.

#![allow(unsafe_code)]

use std::io::{self, IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

use nix::sys::socket::{recvmsg, sendmsg, ControlMessage, ControlMessageOwned, MsgFlags};

/// The most descriptors one message carries here.
const MAX_FDS: usize = 8;

/// Sends `data` with `fds` attached to its first byte; returns how many
/// bytes went (a stream socket may take fewer).
pub fn send_with_fds(
    sock: BorrowedFd<'_>,
    data: &[u8],
    fds: &[BorrowedFd<'_>],
) -> io::Result<usize> {
    let raw: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
    let cmsg = [ControlMessage::ScmRights(&raw)];
    sendmsg::<()>(
        sock.as_raw_fd(),
        &[IoSlice::new(data)],
        &cmsg,
        MsgFlags::MSG_NOSIGNAL,
        None,
    )
    .map_err(io::Error::from)
}

/// Receives into `buf` with the descriptors that came along (close-on-exec);
/// 0 bytes is the end of the stream.
pub fn recv_with_fds(sock: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<(usize, Vec<OwnedFd>)> {
    let mut cmsg = nix::cmsg_space!([RawFd; MAX_FDS]);
    let mut iov = [IoSliceMut::new(buf)];
    let msg = recvmsg::<()>(
        sock.as_raw_fd(),
        &mut iov,
        Some(&mut cmsg),
        MsgFlags::MSG_CMSG_CLOEXEC,
    )
    .map_err(io::Error::from)?;
    let mut fds = Vec::new();
    for c in msg.cmsgs().map_err(io::Error::from)? {
        if let ControlMessageOwned::ScmRights(raw) = c {
            // SAFETY: the kernel installed these descriptors for us.
            fds.extend(raw.into_iter().map(|f| unsafe { OwnedFd::from_raw_fd(f) }));
        }
    }
    Ok((msg.bytes, fds))
}

/// Without waiting: the pid the kernel attached to the next message on
/// `sock` (whose `SO_PASSCRED` is on), in this process's pid namespace.
/// `None` when nothing is there (or the peer closed).
pub fn try_recv_pid(sock: BorrowedFd<'_>) -> Option<i32> {
    let mut byte = [0u8; 1];
    let mut cmsg = nix::cmsg_space!(nix::sys::socket::UnixCredentials);
    let mut iov = [IoSliceMut::new(&mut byte)];
    let msg = recvmsg::<()>(
        sock.as_raw_fd(),
        &mut iov,
        Some(&mut cmsg),
        MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_CMSG_CLOEXEC,
    )
    .ok()?;
    if msg.bytes == 0 {
        return None;
    }
    msg.cmsgs().ok()?.find_map(|c| match c {
        ControlMessageOwned::ScmCredentials(cred) => Some(cred.pid()),
        _ => None,
    })
}
