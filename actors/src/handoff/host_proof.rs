//! Host proofs: how a prefill instance verifies that a decode instance claiming to run on this
//! host (a precondition of same-GPU P/D over CUDA IPC, see [`super::device`]) really does.
//!
//! [`HostProofs`] keeps one file per process in a per-user directory on tmpfs
//! (`$PDSERVE_HOST_PROOF_DIR`, else `/dev/shm/pdserve-host-proofs-<uid>`), created with mode
//! 0700 and used only while it is a real directory of ours that nobody else may write; each
//! file (`<proof_id as 16 hex digits>.proof`, mode 0600, removed when the instance drops its
//! context) holds the 32-byte nonce and the engine id of the advertisement. A peer claiming
//! this host is verified by reading the file its `proof_id` names.

use pdserve_core::handoff::kv_path::{self, HostIdentity, HostProof, HOST_NONCE_BYTES};
use pdserve_runtime::ids::TransferId;
use std::io::Read;
use std::path::{Path, PathBuf};

/// Environment variable naming the host-proof directory (see the module doc).
pub const HOST_PROOF_DIR_ENV: &str = "PDSERVE_HOST_PROOF_DIR";

/// This host's proof files (see the module doc).
#[derive(Clone, Debug)]
pub struct HostProofs {
    dir: PathBuf,
}

/// A published proof: the identity to advertise; its file is removed on drop.
#[derive(Debug)]
pub struct PublishedProof {
    /// What the placement advertises.
    pub identity: HostIdentity,
    path: PathBuf,
}

impl Drop for PublishedProof {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// The kernel's boot id, or empty where there is none (never the same host then).
pub fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().chars().take(kv_path::MAX_BOOT_ID_BYTES).collect())
        .unwrap_or_default()
}

impl HostProofs {
    /// The directory of [`HOST_PROOF_DIR_ENV`], else the per-user default on `/dev/shm`.
    pub fn from_env() -> Self {
        let dir = std::env::var_os(HOST_PROOF_DIR_ENV)
            .map(PathBuf::from)
            .unwrap_or_else(|| {
                let uid = own_uid().unwrap_or(u32::MAX);
                PathBuf::from(format!("/dev/shm/pdserve-host-proofs-{uid}"))
            });
        Self { dir }
    }

    /// Proofs in `dir`.
    pub fn at(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into() }
    }

    /// Writes a fresh proof of `engine_id` under `boot_id`.
    ///
    /// # Errors
    /// The directory is not ours alone, or the file cannot be written.
    pub fn publish(&self, engine_id: &str, boot_id: String) -> std::io::Result<PublishedProof> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        self.ensure_dir()?;
        let key = pdserve_transport::SessionKey::generate().map_err(std::io::Error::other)?;
        let mut nonce = [0u8; HOST_NONCE_BYTES];
        nonce.copy_from_slice(&key.as_bytes()[..HOST_NONCE_BYTES]);
        let proof_id = TransferId::new_random().0 as u64;
        let path = self.file(proof_id);
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)?;
        let published = PublishedProof {
            identity: HostIdentity {
                boot_id,
                proof_id,
                nonce,
            },
            path,
        };
        f.write_all(&nonce)?;
        f.write_all(engine_id.as_bytes())?;
        Ok(published)
    }

    /// What this host holds for `claimed`'s proof id: [`HostProof::NotFound`] when nothing
    /// (or the directory is not ours alone, or the file is malformed).
    pub fn lookup(&self, claimed: &HostIdentity) -> HostProof {
        if self.check_dir().is_err() {
            return HostProof::NotFound;
        }
        let Ok(f) = std::fs::File::open(self.file(claimed.proof_id)) else {
            return HostProof::NotFound;
        };
        let mut bytes = Vec::new();
        let limit = (HOST_NONCE_BYTES + kv_path::MAX_ENGINE_ID_BYTES) as u64;
        if f.take(limit + 1).read_to_end(&mut bytes).is_err()
            || bytes.len() as u64 > limit
            || bytes.len() < HOST_NONCE_BYTES
        {
            return HostProof::NotFound;
        }
        let (n, engine) = bytes.split_at(HOST_NONCE_BYTES);
        let Ok(engine_id) = std::str::from_utf8(engine) else {
            return HostProof::NotFound;
        };
        let mut nonce = [0u8; HOST_NONCE_BYTES];
        nonce.copy_from_slice(n);
        HostProof::Found {
            engine_id: engine_id.to_string(),
            nonce,
        }
    }

    fn file(&self, proof_id: u64) -> PathBuf {
        self.dir.join(format!("{proof_id:016x}.proof"))
    }

    fn ensure_dir(&self) -> std::io::Result<()> {
        use std::os::unix::fs::DirBuilderExt;
        match std::fs::DirBuilder::new().mode(0o700).create(&self.dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e),
        }
        self.check_dir()
    }

    /// The directory must be a real directory (not a link) of this user that no one else may
    /// write or read: otherwise another user could plant proofs.
    fn check_dir(&self) -> std::io::Result<()> {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::symlink_metadata(&self.dir)?;
        let ours = own_uid()?;
        if !m.is_dir() || m.uid() != ours || m.mode() & 0o077 != 0 {
            return Err(std::io::Error::other(format!(
                "{} is not a private directory of uid {ours}",
                self.dir.display()
            )));
        }
        Ok(())
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

fn own_uid() -> std::io::Result<u32> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self").map(|m| m.uid())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn private_dir() -> (tempfile::TempDir, HostProofs) {
        let t = tempfile::tempdir().unwrap();
        let dir = t.path().join("proofs");
        (t, HostProofs::at(dir))
    }

    #[test]
    fn a_published_proof_is_found_here_until_dropped() {
        let (_t, proofs) = private_dir();
        let p = proofs.publish("p0", "boot".into()).unwrap();
        let mode = std::fs::metadata(proofs.dir())
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o700);
        assert_eq!(
            proofs.lookup(&p.identity),
            HostProof::Found {
                engine_id: "p0".into(),
                nonce: p.identity.nonce,
            }
        );
        let mut other = p.identity.clone();
        other.proof_id ^= 1;
        assert_eq!(proofs.lookup(&other), HostProof::NotFound);
        let q = proofs.publish("p1", "boot".into()).unwrap();
        assert_ne!(q.identity.nonce, p.identity.nonce);
        assert_ne!(q.identity.proof_id, p.identity.proof_id);
        let id = p.identity.clone();
        drop(p);
        assert_eq!(proofs.lookup(&id), HostProof::NotFound);
    }

    #[test]
    fn a_directory_others_may_write_is_not_trusted() {
        let (_t, proofs) = private_dir();
        let p = proofs.publish("p0", "boot".into()).unwrap();
        std::fs::set_permissions(proofs.dir(), std::fs::Permissions::from_mode(0o777)).unwrap();
        assert_eq!(proofs.lookup(&p.identity), HostProof::NotFound);
        assert!(proofs.publish("p1", "boot".into()).is_err());
        // A link to a directory is not the directory.
        std::fs::set_permissions(proofs.dir(), std::fs::Permissions::from_mode(0o700)).unwrap();
        let link = proofs.dir().with_file_name("link");
        std::os::unix::fs::symlink(proofs.dir(), &link).unwrap();
        assert_eq!(
            HostProofs::at(&link).lookup(&p.identity),
            HostProof::NotFound
        );
    }

    #[test]
    fn malformed_proof_files_prove_nothing() {
        let (_t, proofs) = private_dir();
        let p = proofs.publish("p0", "boot".into()).unwrap();
        let file = proofs.file(p.identity.proof_id);
        for bytes in [
            vec![1u8; HOST_NONCE_BYTES - 1],
            [vec![0u8; HOST_NONCE_BYTES], vec![0xff, 0xfe]].concat(),
            vec![b'a'; HOST_NONCE_BYTES + kv_path::MAX_ENGINE_ID_BYTES + 1],
        ] {
            std::fs::write(&file, &bytes).unwrap();
            assert_eq!(proofs.lookup(&p.identity), HostProof::NotFound);
        }
    }

    #[test]
    fn the_boot_id_is_read_here() {
        // Linux test machines have one; it is what two processes of one kernel share.
        let b = boot_id();
        assert_eq!(b, boot_id());
        assert!(b.len() <= kv_path::MAX_BOOT_ID_BYTES);
    }
}
