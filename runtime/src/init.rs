//! The run's PID 1: a tiny static executable (see `init/init.c`) embedded in
//! the sbx binary and installed read-only under the state dir, so it runs in
//! any image (busybox-static has no libc to load a dynamic binary with) and
//! an idle run costs almost no memory.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

pub const INIT_BINARY: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/sbx-init"));

/// Writes the init to `<dir>/sbx-init` (0555, atomically) unless it is
/// already there with the same bytes; returns its path.
pub fn install(dir: &Path) -> std::io::Result<PathBuf> {
    std::fs::create_dir_all(dir)?;
    let path = dir.join("sbx-init");
    if std::fs::read(&path).is_ok_and(|b| b == INIT_BINARY) {
        return Ok(path);
    }
    let tmp = dir.join("sbx-init.tmp");
    std::fs::write(&tmp, INIT_BINARY)?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o555))?;
    std::fs::rename(&tmp, &path)?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_init_installs_the_filter_it_is_given_or_refuses_to_run() {
        let d = tempfile::tempdir().expect("tmp");
        let init = install(d.path()).expect("install");
        // Malformed: not hex, or not whole sock_filter records.
        for bad in ["zz00000000000000", "0600000000", ""] {
            let st = std::process::Command::new(&init)
                .args(["--seccomp", bad])
                .stderr(std::process::Stdio::null())
                .status()
                .expect("run init");
            assert_eq!(st.code(), Some(126), "{bad:?}");
        }
        // One instruction: return SECCOMP_RET_ALLOW (0x7fff0000).
        let mut child = std::process::Command::new(&init)
            .args(["--seccomp", "060000000000ff7f"])
            .spawn()
            .expect("run init");
        let status = format!("/proc/{}/status", child.id());
        let mut filtered = false;
        for _ in 0..200 {
            let text = std::fs::read_to_string(&status).unwrap_or_default();
            if text.contains("Seccomp:\t2") {
                filtered = true;
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let _ = child.kill();
        let _ = child.wait();
        assert!(filtered, "init did not install its filter");
    }

    #[test]
    fn the_embedded_init_is_a_static_elf() {
        assert_eq!(&INIT_BINARY[..4], b"\x7fELF");
        // No PT_INTERP program header: it needs no dynamic loader in the image.
        let b = INIT_BINARY;
        let u16_at = |o: usize| u16::from_le_bytes([b[o], b[o + 1]]) as usize;
        let phoff = u64::from_le_bytes(b[0x20..0x28].try_into().expect("phoff")) as usize;
        let (phentsize, phnum) = (u16_at(0x36), u16_at(0x38));
        assert!(phnum > 0);
        for i in 0..phnum {
            let o = phoff + i * phentsize;
            let p_type = u32::from_le_bytes(b[o..o + 4].try_into().expect("p_type"));
            assert_ne!(p_type, 3, "init must be static (has PT_INTERP)");
        }
        let d = tempfile::tempdir().expect("tmp");
        let p = install(d.path()).expect("install");
        let mode = std::fs::metadata(&p).expect("meta").permissions().mode() & 0o777;
        assert_eq!(mode, 0o555);
        assert_eq!(install(d.path()).expect("again"), p);
    }
}
