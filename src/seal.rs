//! Encryption at rest for create-time env: ChaCha20-Poly1305 with a random
//! key kept in `<state>/env.key` (mode 0600).

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use chacha20poly1305::aead::{Aead, KeyInit};
use chacha20poly1305::{ChaCha20Poly1305, Key, Nonce};

#[derive(Debug, thiserror::Error)]
pub enum SealError {
    #[error("key file {path}")]
    KeyFile {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("key file {path} is not 32 bytes")]
    KeyLength { path: std::path::PathBuf },
    #[error("sealed value is corrupt or was sealed with another key")]
    Open,
}

/// Writes a secret file atomically with mode 0600 (temp file, fsync, rename).
pub fn write_private(path: &Path, body: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)?;
    f.write_all(body)?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)
}

pub struct Sealer {
    cipher: ChaCha20Poly1305,
}

impl Sealer {
    /// Loads the key, minting it (0600) on first use.
    pub fn load_or_create(path: &Path) -> Result<Sealer, SealError> {
        let err = |source| SealError::KeyFile {
            path: path.to_path_buf(),
            source,
        };
        let key = match std::fs::read(path) {
            Ok(k) => k,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let key: [u8; 32] = rand::random();
                write_private(path, &key).map_err(err)?;
                key.to_vec()
            }
            Err(e) => return Err(err(e)),
        };
        if key.len() != 32 {
            return Err(SealError::KeyLength {
                path: path.to_path_buf(),
            });
        }
        Ok(Sealer {
            cipher: ChaCha20Poly1305::new(Key::from_slice(&key)),
        })
    }

    pub fn seal(&self, plain: &[u8]) -> Vec<u8> {
        let nonce: [u8; 12] = rand::random();
        let mut out = nonce.to_vec();
        // Encryption with a fresh nonce and in-memory buffers cannot fail.
        out.extend(
            self.cipher
                .encrypt(Nonce::from_slice(&nonce), plain)
                .unwrap_or_default(),
        );
        out
    }

    pub fn open(&self, sealed: &[u8]) -> Result<Vec<u8>, SealError> {
        if sealed.len() < 12 {
            return Err(SealError::Open);
        }
        let (nonce, body) = sealed.split_at(12);
        self.cipher
            .decrypt(Nonce::from_slice(nonce), body)
            .map_err(|_| SealError::Open)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn seals_and_opens_with_a_0600_key() {
        let dir = tempfile::tempdir().expect("tmp");
        let key = dir.path().join("env.key");
        let s = Sealer::load_or_create(&key).expect("sealer");
        let mode = std::fs::metadata(&key).expect("meta").permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let sealed = s.seal(b"TOKEN=hunter2");
        assert!(
            !sealed.windows(7).any(|w| w == b"hunter2"),
            "plaintext must not appear"
        );
        let again = Sealer::load_or_create(&key).expect("reload");
        assert_eq!(again.open(&sealed).expect("open"), b"TOKEN=hunter2");
        let mut bad = sealed.clone();
        bad[20] ^= 1;
        assert!(matches!(again.open(&bad), Err(SealError::Open)));
    }
}
