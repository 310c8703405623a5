//! The built-in `host` image: no pull. The run's root is a small directory
//! of its own with the host's `/usr` (and the `/bin`, `/lib*` entries that
//! point into it) mounted read-only, a generated `/etc` with nothing of the
//! host's, and a writable `/work`.

use std::fs;
use std::io;
use std::os::unix::fs::{symlink, PermissionsExt};
use std::path::{Path, PathBuf};

/// A read-only host directory to bind into the run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostBind {
    pub source: PathBuf,
    pub destination: String,
}

/// Identity of the run's user, for the generated `/etc`.
#[derive(Debug, Clone, Copy)]
pub struct RunUser {
    pub uid: u32,
    pub gid: u32,
}

const TOP_LINKS: &[&str] = &["bin", "sbin", "lib", "lib32", "lib64", "libx32"];

/// Lays out the `host` image's root in `rootfs` (an empty directory) and
/// returns the read-only binds the runtime must add. `host_root` is `/` in
/// production and a fixture in tests.
pub fn prepare(
    rootfs: &Path,
    host_root: &Path,
    id: &str,
    user: RunUser,
) -> io::Result<Vec<HostBind>> {
    for d in [
        "usr", "etc", "tmp", "proc", "dev", "sys", "root", "run", "var", "var/tmp", ".sbx",
    ] {
        fs::create_dir_all(rootfs.join(d))?;
    }
    fs::set_permissions(rootfs.join("tmp"), fs::Permissions::from_mode(0o1777))?;
    fs::set_permissions(rootfs.join("var/tmp"), fs::Permissions::from_mode(0o1777))?;
    fs::set_permissions(rootfs.join("root"), fs::Permissions::from_mode(0o700))?;
    let mut binds = vec![HostBind {
        source: host_root.join("usr"),
        destination: "/usr".into(),
    }];
    for name in TOP_LINKS {
        let host = host_root.join(name);
        match fs::symlink_metadata(&host) {
            Ok(m) if m.file_type().is_symlink() => {
                symlink(fs::read_link(&host)?, rootfs.join(name))?
            }
            Ok(m) if m.is_dir() => {
                fs::create_dir_all(rootfs.join(name))?;
                binds.push(HostBind {
                    source: host,
                    destination: format!("/{name}"),
                });
            }
            _ => {}
        }
    }
    write_etc(&rootfs.join("etc"), id, user)?;
    Ok(binds)
}

/// passwd, group, hosts, resolv.conf, nsswitch.conf — generated, never copied.
pub fn write_etc(etc: &Path, id: &str, user: RunUser) -> io::Result<()> {
    fs::write(etc.join("passwd"), passwd(user))?;
    fs::write(etc.join("group"), group(user))?;
    fs::write(
        etc.join("hosts"),
        format!("127.0.0.1\tlocalhost {id}\n::1\tlocalhost ip6-localhost\n"),
    )?;
    fs::write(etc.join("resolv.conf"), "# no DNS on this network\n")?;
    fs::write(
        etc.join("nsswitch.conf"),
        "passwd: files\ngroup: files\nhosts: files dns\n",
    )?;
    Ok(())
}

fn passwd(u: RunUser) -> String {
    let mut s = String::from("root:x:0:0:root:/root:/bin/sh\n");
    if u.uid != 0 {
        s.push_str(&format!("sbx:x:{}:{}:sbx:/work:/bin/sh\n", u.uid, u.gid));
    }
    s.push_str("nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n");
    s
}

fn group(u: RunUser) -> String {
    let mut s = String::from("root:x:0:\n");
    if u.gid != 0 {
        s.push_str(&format!("sbx:x:{}:\n", u.gid));
    }
    s.push_str("nogroup:x:65534:\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lays_out_a_root_with_usr_bound_and_links_copied() {
        let host = tempfile::tempdir().expect("host");
        fs::create_dir(host.path().join("usr")).expect("usr");
        symlink("usr/bin", host.path().join("bin")).expect("bin link");
        fs::create_dir(host.path().join("lib64")).expect("lib64 dir");
        let root = tempfile::tempdir().expect("root");
        let binds = prepare(
            root.path(),
            host.path(),
            "01JX",
            RunUser {
                uid: 1000,
                gid: 1000,
            },
        )
        .expect("prepare");
        assert_eq!(
            binds,
            vec![
                HostBind {
                    source: host.path().join("usr"),
                    destination: "/usr".into()
                },
                HostBind {
                    source: host.path().join("lib64"),
                    destination: "/lib64".into()
                },
            ]
        );
        assert_eq!(
            fs::read_link(root.path().join("bin")).expect("link"),
            PathBuf::from("usr/bin")
        );
        let passwd = fs::read_to_string(root.path().join("etc/passwd")).expect("passwd");
        assert!(passwd.contains("sbx:x:1000:1000:sbx:/work:/bin/sh"));
        let hosts = fs::read_to_string(root.path().join("etc/hosts")).expect("hosts");
        assert!(hosts.contains("localhost 01JX"));
        let etc: Vec<_> = fs::read_dir(root.path().join("etc"))
            .expect("etc")
            .flatten()
            .collect();
        assert_eq!(etc.len(), 5, "nothing of the host's /etc");
    }

    #[test]
    fn root_user_gets_no_extra_entry() {
        let p = passwd(RunUser { uid: 0, gid: 0 });
        assert_eq!(p.lines().count(), 2);
    }
}
