//! Overlay assembly: the run's root as an overlay of image layers with a
//! per-run upper dir. Uses the new mount API with `lowerdir+` (one layer per
//! call, so images with many layers fit) when the kernel has it, and the
//! classic option string otherwise.

use std::io;
use std::path::{Path, PathBuf};

use rustix::mount::{
    fsconfig_create, fsconfig_set_string, fsmount, fsopen, move_mount, FsMountFlags, FsOpenFlags,
    MountAttrFlags, MoveMountFlags,
};

#[derive(Debug, thiserror::Error)]
pub enum OverlayError {
    #[error("mount overlay on {target}")]
    Mount {
        target: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("unmount {target}")]
    Unmount {
        target: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("overlay needs at least one lower layer")]
    NoLayers,
}

/// Which mount interface assembled an overlay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MountApi {
    /// `fsopen` + `lowerdir+` per layer: no option-string length limit.
    LowerdirPlus,
    /// `mount(2)` with one option string (older kernels).
    Legacy,
}

/// Mounts `lowers` (topmost first) + `upper`/`work` on `target`.
pub fn mount(
    lowers: &[PathBuf],
    upper: &Path,
    work: &Path,
    target: &Path,
) -> Result<MountApi, OverlayError> {
    if lowers.is_empty() {
        return Err(OverlayError::NoLayers);
    }
    let err = |source: io::Error| OverlayError::Mount {
        target: target.to_path_buf(),
        source,
    };
    match mount_new_api(lowers, upper, work, target) {
        Ok(()) => Ok(MountApi::LowerdirPlus),
        Err(e)
            if e.raw_os_error() == Some(libc::ENOSYS) || e.raw_os_error() == Some(libc::EINVAL) =>
        {
            mount_legacy(lowers, upper, work, target).map_err(err)?;
            Ok(MountApi::Legacy)
        }
        Err(e) => Err(err(e)),
    }
}

fn mount_new_api(lowers: &[PathBuf], upper: &Path, work: &Path, target: &Path) -> io::Result<()> {
    let fs = fsopen("overlay", FsOpenFlags::FSOPEN_CLOEXEC)?;
    for l in lowers {
        fsconfig_set_string(&fs, "lowerdir+", l.as_path())?;
    }
    fsconfig_set_string(&fs, "upperdir", upper)?;
    fsconfig_set_string(&fs, "workdir", work)?;
    // Not every kernel knows these; they only tighten behaviour.
    let _ = fsconfig_set_string(&fs, "index", "off");
    fsconfig_create(&fs)?;
    let mnt = fsmount(
        &fs,
        FsMountFlags::FSMOUNT_CLOEXEC,
        MountAttrFlags::MOUNT_ATTR_NODEV,
    )?;
    move_mount(
        &mnt,
        "",
        rustix::fs::CWD,
        target,
        MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH,
    )?;
    Ok(())
}

fn mount_legacy(lowers: &[PathBuf], upper: &Path, work: &Path, target: &Path) -> io::Result<()> {
    let lower: Vec<String> = lowers.iter().map(|p| p.display().to_string()).collect();
    let opts = format!(
        "lowerdir={},upperdir={},workdir={},index=off",
        lower.join(":"),
        upper.display(),
        work.display()
    );
    let opts = std::ffi::CString::new(opts).map_err(io::Error::other)?;
    rustix::mount::mount(
        "overlay",
        target,
        "overlay",
        rustix::mount::MountFlags::NODEV,
        Some(opts.as_c_str()),
    )?;
    Ok(())
}

/// Detaches whatever is mounted on `target`; not mounted is fine.
pub fn unmount(target: &Path) -> Result<(), OverlayError> {
    match rustix::mount::unmount(target, rustix::mount::UnmountFlags::DETACH) {
        Ok(()) => Ok(()),
        Err(e) if e == rustix::io::Errno::INVAL || e == rustix::io::Errno::NOENT => Ok(()),
        Err(e) => Err(OverlayError::Unmount {
            target: target.to_path_buf(),
            source: e.into(),
        }),
    }
}

/// Mount points at or below `dir`, from `/proc/self/mountinfo` text. Pure.
pub fn mounts_under(mountinfo: &str, dir: &Path) -> Vec<PathBuf> {
    mountinfo
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(unescape)
        .map(PathBuf::from)
        .filter(|p| p.starts_with(dir))
        .collect()
}

fn unescape(s: &str) -> String {
    s.replace("\\040", " ")
        .replace("\\011", "\t")
        .replace("\\012", "\n")
        .replace("\\134", "\\")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_mounts_below_a_directory() {
        let mi = "\
22 1 0:21 / / rw - ext4 /dev/vda rw
90 22 0:50 / /var/lib/sbx/runs/A/rootfs rw - overlay overlay rw
91 22 0:51 / /var/lib/sbx/runs/AB/rootfs rw - overlay overlay rw
92 22 0:52 / /var/lib/sbx/runs/A/x\\040y rw - tmpfs tmpfs rw
";
        let got = mounts_under(mi, Path::new("/var/lib/sbx/runs/A"));
        assert_eq!(
            got,
            vec![
                PathBuf::from("/var/lib/sbx/runs/A/rootfs"),
                PathBuf::from("/var/lib/sbx/runs/A/x y")
            ]
        );
    }

    #[test]
    fn mounts_many_layers_with_lowerdir_plus() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("SKIPPED mounts_many_layers_with_lowerdir_plus: mounting needs root");
            return;
        }
        let t = tempfile::tempdir().expect("tmp");
        // More layers than fit in one legacy option string of 4 KiB paths.
        let long = t.path().join("l".repeat(200));
        let mut lowers = Vec::new();
        for i in 0..40 {
            let d = long.join(format!("layer-{i:03}"));
            std::fs::create_dir_all(&d).expect("layer");
            std::fs::write(d.join(format!("f{i}")), b"x").expect("file");
            lowers.push(d);
        }
        lowers.reverse();
        let (upper, work, target) = (t.path().join("u"), t.path().join("w"), t.path().join("m"));
        for d in [&upper, &work, &target] {
            std::fs::create_dir(d).expect("dir");
        }
        let api = mount(&lowers, &upper, &work, &target).expect("mount");
        let seen = std::fs::read_dir(&target).expect("read").count();
        unmount(&target).expect("unmount");
        assert_eq!(api, MountApi::LowerdirPlus);
        assert_eq!(seen, 40);
    }

    #[test]
    fn refuses_an_empty_layer_list() {
        let t = tempfile::tempdir().expect("tmp");
        assert!(matches!(
            mount(&[], t.path(), t.path(), t.path()),
            Err(OverlayError::NoLayers)
        ));
    }
}
