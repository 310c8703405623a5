//! File access confined to a run's `/work`, resolved inside the run's root
//! with `openat2(RESOLVE_IN_ROOT)` from file descriptors, so symlinks, `..`
//! and swaps between check and use never reach a host file. Blocking; call
//! from `spawn_blocking`.

use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

use rustix::fs::{openat2, AtFlags, Mode, OFlags, ResolveFlags};

#[derive(Debug, thiserror::Error)]
pub enum FileError {
    #[error("{0}")]
    BadPath(String),
    #[error("no such file or directory")]
    NotFound,
    #[error("larger than the limit of {0} bytes")]
    TooLarge(u64),
    #[error("not a regular file or directory")]
    NotRegular,
    #[error("io")]
    Io(#[from] std::io::Error),
}

impl From<rustix::io::Errno> for FileError {
    fn from(e: rustix::io::Errno) -> Self {
        match e {
            rustix::io::Errno::NOENT => FileError::NotFound,
            rustix::io::Errno::LOOP => FileError::BadPath("path crosses a symlink".into()),
            rustix::io::Errno::XDEV => FileError::BadPath("path leaves /work".into()),
            rustix::io::Errno::NOTDIR => FileError::BadPath("a parent is not a directory".into()),
            rustix::io::Errno::ISDIR => FileError::BadPath("path is a directory".into()),
            rustix::io::Errno::NXIO => FileError::NotRegular,
            other => FileError::Io(other.into()),
        }
    }
}

#[derive(Debug, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DirEntry {
    pub name: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub size: u64,
    pub mode: String,
    pub modified_at: String,
}

pub enum Content {
    File(Vec<u8>),
    Dir(Vec<DirEntry>),
}

/// Splits a request path (relative to `/work`) into checked components.
pub fn components(rel: &str) -> Result<Vec<String>, FileError> {
    let mut out = Vec::new();
    for c in rel.split('/') {
        match c {
            "" | "." => continue,
            ".." => return Err(FileError::BadPath("'..' is not allowed".into())),
            c if c.contains('\0') => return Err(FileError::BadPath("NUL in path".into())),
            c if c.len() > 255 => return Err(FileError::BadPath("path component too long".into())),
            c => out.push(c.to_string()),
        }
    }
    Ok(out)
}

fn open_root(rootfs: &Path) -> Result<OwnedFd, FileError> {
    Ok(rustix::fs::open(
        rootfs,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )?)
}

fn fd_path(fd: &OwnedFd) -> Result<PathBuf, FileError> {
    let p = std::fs::read_link(format!(
        "/proc/self/fd/{}",
        std::os::fd::AsRawFd::as_raw_fd(fd)
    ))?;
    Ok(p)
}

fn reopen(fd: &OwnedFd, flags: OFlags) -> Result<std::fs::File, FileError> {
    let p = format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(fd));
    let f = rustix::fs::open(
        p.as_str(),
        flags | OFlags::CLOEXEC | OFlags::NOCTTY | OFlags::NONBLOCK,
        Mode::empty(),
    )?;
    Ok(std::fs::File::from(f))
}

fn mode_string(mode: u32) -> String {
    format!("{:04o}", mode & 0o7777)
}

fn kind(mode: u32) -> &'static str {
    match mode & libc::S_IFMT {
        libc::S_IFREG => "file",
        libc::S_IFDIR => "dir",
        libc::S_IFLNK => "symlink",
        _ => "other",
    }
}

/// Reads a file (capped at `max`) or lists a directory under `/work`.
pub fn read(rootfs: &Path, rel: &str, max: u64) -> Result<Content, FileError> {
    let comps = components(rel)?;
    let root = open_root(rootfs)?;
    let path = format!("/work/{}", comps.join("/"));
    let fd = openat2(
        &root,
        path.as_str(),
        OFlags::PATH | OFlags::CLOEXEC,
        Mode::empty(),
        ResolveFlags::IN_ROOT | ResolveFlags::NO_MAGICLINKS,
    )?;
    // Symlinks resolve inside the run's root; the result must still be in /work.
    let real = fd_path(&fd)?;
    let work = rootfs.join("work");
    if !real.starts_with(&work) {
        return Err(FileError::BadPath("path resolves outside /work".into()));
    }
    let st = rustix::fs::fstat(&fd)?;
    match st.st_mode & libc::S_IFMT {
        libc::S_IFREG => {
            if st.st_size as u64 > max {
                return Err(FileError::TooLarge(max));
            }
            let f = reopen(&fd, OFlags::RDONLY)?;
            let mut buf = Vec::with_capacity(st.st_size as usize);
            f.take(max + 1).read_to_end(&mut buf)?;
            if buf.len() as u64 > max {
                return Err(FileError::TooLarge(max));
            }
            Ok(Content::File(buf))
        }
        libc::S_IFDIR => {
            let dirf = reopen(&fd, OFlags::RDONLY | OFlags::DIRECTORY)?;
            let mut entries = Vec::new();
            let mut dir = rustix::fs::Dir::read_from(&dirf)?;
            while let Some(e) = dir.read() {
                let e = e?;
                let name = e.file_name().to_string_lossy().into_owned();
                if name == "." || name == ".." {
                    continue;
                }
                let Ok(st) = rustix::fs::statat(&dirf, e.file_name(), AtFlags::SYMLINK_NOFOLLOW)
                else {
                    continue;
                };
                entries.push(DirEntry {
                    name,
                    kind: kind(st.st_mode),
                    size: st.st_size as u64,
                    mode: mode_string(st.st_mode),
                    modified_at: super::rfc3339(st.st_mtime * 1000),
                });
            }
            entries.sort_by(|a, b| a.name.cmp(&b.name));
            Ok(Content::Dir(entries))
        }
        _ => Err(FileError::NotRegular),
    }
}

fn beneath() -> ResolveFlags {
    ResolveFlags::BENEATH
        | ResolveFlags::NO_SYMLINKS
        | ResolveFlags::NO_MAGICLINKS
        | ResolveFlags::NO_XDEV
}

/// Writes `data` to `/work/<rel>` atomically (temp file + rename), creating
/// parents; everything created is owned by the run's user.
pub fn write(
    rootfs: &Path,
    rel: &str,
    data: &[u8],
    mode: u32,
    uid: u32,
    gid: u32,
) -> Result<(), FileError> {
    let comps = components(rel)?;
    let Some((name, parents)) = comps.split_last() else {
        return Err(FileError::BadPath("a file name is required".into()));
    };
    let root = open_root(rootfs)?;
    let work = openat2(
        &root,
        "work",
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
        beneath(),
    )?;
    let owner = (
        Some(rustix::fs::Uid::from_raw(uid)),
        Some(rustix::fs::Gid::from_raw(gid)),
    );
    // Parents it creates belong to the run's user.
    let dir = walk_create(work, parents, |parent, c| {
        rustix::fs::chownat(parent, c, owner.0, owner.1, AtFlags::SYMLINK_NOFOLLOW)?;
        Ok(())
    })?;
    replace_file(&dir, name, data, mode, Some((uid, gid)))
}

/// Replaces `name` in directory `dir` atomically: a temp file is written,
/// given `mode` (and `owner`), then renamed over `name` — which replaces a
/// symlink at `name` itself, never its target.
fn replace_file(
    dir: &OwnedFd,
    name: &str,
    data: &[u8],
    mode: u32,
    owner: Option<(u32, u32)>,
) -> Result<(), FileError> {
    let d = reopen(dir, OFlags::RDONLY | OFlags::DIRECTORY)?;
    let tmp = format!(".{name}.sbx-{:016x}", rand::random::<u64>());
    let fd = rustix::fs::openat(
        &d,
        tmp.as_str(),
        OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::from_raw_mode(0o600),
    )?;
    let result = (|| -> Result<(), FileError> {
        let mut f = std::fs::File::from(fd);
        f.write_all(data)?;
        set_owner_mode(&f, owner, mode & 0o7777)?;
        rustix::fs::renameat(&d, tmp.as_str(), &d, name)?;
        Ok(())
    })();
    if result.is_err() {
        let _ = rustix::fs::unlinkat(&d, tmp.as_str(), AtFlags::empty());
    }
    result
}

/// `owner` (when given), then `mode`, on an open file or directory.
fn set_owner_mode(
    fd: impl std::os::fd::AsFd,
    owner: Option<(u32, u32)>,
    mode: u32,
) -> Result<(), FileError> {
    if let Some((uid, gid)) = owner {
        rustix::fs::fchown(
            &fd,
            Some(rustix::fs::Uid::from_raw(uid)),
            Some(rustix::fs::Gid::from_raw(gid)),
        )?;
    }
    rustix::fs::fchmod(&fd, Mode::from_raw_mode(mode))?;
    Ok(())
}

/// Opens (creating as needed) directory `rel` of a run's root: no
/// component may be a symlink, so an image cannot point the daemon at a
/// host directory. Created or not, the final directory gets `mode` and,
/// when given, `owner`.
pub fn ensure_dir(
    rootfs: &Path,
    rel: &str,
    mode: u32,
    owner: Option<(u32, u32)>,
) -> Result<OwnedFd, FileError> {
    let comps = components(rel)?;
    let dir = walk_create(open_root(rootfs)?, &comps, |_, _| Ok(()))?;
    if !comps.is_empty() {
        let d = reopen(&dir, OFlags::RDONLY | OFlags::DIRECTORY)?;
        set_owner_mode(&d, owner, mode)?;
    }
    Ok(dir)
}

/// Replaces file `rel` of a run's root (root-owned) without following any
/// symlink an image put there.
pub fn write_root_file(rootfs: &Path, rel: &str, data: &[u8], mode: u32) -> Result<(), FileError> {
    let comps = components(rel)?;
    let Some((name, parents)) = comps.split_last() else {
        return Err(FileError::BadPath("a file name is required".into()));
    };
    let dir = walk_create(open_root(rootfs)?, parents, |_, _| Ok(()))?;
    replace_file(&dir, name, data, mode, None)
}

/// Walks `comps` down from `dir`, creating missing directories (0755) and
/// never passing through a symlink; `created(parent, name)` runs for each
/// directory it makes.
fn walk_create(
    mut dir: OwnedFd,
    comps: &[String],
    mut created: impl FnMut(&std::fs::File, &str) -> Result<(), FileError>,
) -> Result<OwnedFd, FileError> {
    for c in comps {
        let open = |d: &OwnedFd| {
            openat2(
                d,
                c.as_str(),
                OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
                Mode::empty(),
                beneath(),
            )
        };
        dir = match open(&dir) {
            Ok(fd) => fd,
            Err(rustix::io::Errno::NOENT) => {
                let parent = reopen(&dir, OFlags::RDONLY | OFlags::DIRECTORY)?;
                match rustix::fs::mkdirat(&parent, c.as_str(), Mode::from_raw_mode(0o755)) {
                    Ok(()) => created(&parent, c)?,
                    Err(rustix::io::Errno::EXIST) => {}
                    Err(e) => return Err(e.into()),
                }
                open(&dir)?
            }
            Err(e) => return Err(e.into()),
        };
    }
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn root() -> tempfile::TempDir {
        let t = tempfile::tempdir().expect("tmp");
        std::fs::create_dir_all(t.path().join("work")).expect("work");
        std::fs::create_dir_all(t.path().join("etc")).expect("etc");
        std::fs::write(t.path().join("etc/passwd"), "root").expect("passwd");
        t
    }

    #[test]
    fn writes_and_reads_inside_work() {
        let t = root();
        let me = (
            nix::unistd::getuid().as_raw(),
            nix::unistd::getgid().as_raw(),
        );
        write(t.path(), "a/b/c.txt", b"hello", 0o640, me.0, me.1).expect("write");
        match read(t.path(), "a/b/c.txt", 100).expect("read") {
            Content::File(b) => assert_eq!(b, b"hello"),
            Content::Dir(_) => panic!("expected a file"),
        }
        match read(t.path(), "a", 100).expect("list") {
            Content::Dir(d) => {
                assert_eq!(d.len(), 1);
                assert_eq!((d[0].name.as_str(), d[0].kind), ("b", "dir"));
            }
            Content::File(_) => panic!("expected a dir"),
        }
        assert!(matches!(
            read(t.path(), "a/b/c.txt", 4),
            Err(FileError::TooLarge(4))
        ));
    }

    #[test]
    fn symlinks_never_reach_outside_work() {
        let t = root();
        std::os::unix::fs::symlink("/etc/passwd", t.path().join("work/abs")).expect("symlink");
        std::os::unix::fs::symlink("../etc/passwd", t.path().join("work/rel")).expect("symlink");
        std::os::unix::fs::symlink("/etc", t.path().join("work/dir")).expect("symlink");
        for p in ["abs", "rel"] {
            assert!(
                matches!(read(t.path(), p, 100), Err(FileError::BadPath(_))),
                "{p}"
            );
        }
        let me = (
            nix::unistd::getuid().as_raw(),
            nix::unistd::getgid().as_raw(),
        );
        assert!(write(t.path(), "dir/passwd", b"x", 0o644, me.0, me.1).is_err());
        assert_eq!(
            std::fs::read_to_string(t.path().join("etc/passwd")).expect("read"),
            "root"
        );
        // Writing over a symlink replaces the link, not its target.
        write(t.path(), "abs", b"mine", 0o644, me.0, me.1).expect("write");
        assert_eq!(
            std::fs::read_to_string(t.path().join("etc/passwd")).expect("read"),
            "root"
        );
        assert_eq!(
            std::fs::read_to_string(t.path().join("work/abs")).expect("read"),
            "mine"
        );
        assert!(matches!(components("a/../b"), Err(FileError::BadPath(_))));
    }

    #[test]
    fn root_helpers_never_follow_an_image_symlink() {
        let t = root();
        let outside = tempfile::tempdir().expect("outside");
        std::os::unix::fs::symlink(outside.path(), t.path().join("work/../lnk")).expect("symlink");
        std::fs::remove_dir(t.path().join("work")).expect("rm work");
        std::os::unix::fs::symlink(outside.path(), t.path().join("work")).expect("work symlink");
        assert!(ensure_dir(t.path(), "work", 0o755, None).is_err());
        assert!(write_root_file(t.path(), "lnk/x", b"x", 0o644).is_err());
        assert_eq!(std::fs::read_dir(outside.path()).expect("dir").count(), 0);
        // A symlinked file is replaced, not written through.
        std::os::unix::fs::symlink(outside.path().join("target"), t.path().join("etc/hostname"))
            .expect("file link");
        write_root_file(t.path(), "etc/hostname", b"run\n", 0o644).expect("write");
        assert!(!outside.path().join("target").exists());
        assert_eq!(
            std::fs::read(t.path().join("etc/hostname")).expect("read"),
            b"run\n"
        );
        ensure_dir(t.path(), "srv/app", 0o750, None).expect("nested");
        assert!(t.path().join("srv/app").is_dir());
    }

    #[test]
    fn fifos_are_refused_without_hanging() {
        let t = root();
        nix::unistd::mkfifo(
            &t.path().join("work/fifo"),
            nix::sys::stat::Mode::from_bits_truncate(0o644),
        )
        .expect("fifo");
        assert!(matches!(
            read(t.path(), "fifo", 100),
            Err(FileError::NotRegular)
        ));
    }
}
