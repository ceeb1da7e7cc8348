//! A transfer peer in its own process, for the conformance tests and the transfer benchmark.
//!
//! The peer (the `pdserve-transfer-peer` binary, or any binary that calls
//! [`run_if_requested`] first thing in `main`) is configured by environment variables, builds a
//! [`TransferEngine`], registers regions filled with [`fill_pattern`], prints
//! `READY <address> <id,id,...>` on stdout and then obeys notifications:
//! `CHECK` prints `CHECK <fnv1a-64 of all regions, hex>`, `DROP` deregisters its last region
//! and prints `DROPPED <id>`, `EXIT` exits. It exits when its stdin closes, so it never outlives
//! the process that started it.

use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::config::{BackendKind, TransferConfig};
use crate::control::tls::MemberCredentials;
use crate::engine::TransferEngine;
use crate::error::{Result, TransportError};
use crate::memory::RegisteredRegion;

/// Names the backend; its presence makes [`run_if_requested`] run the peer.
pub const ENV_BACKEND: &str = "PDSERVE_TRANSFER_PEER";
/// Comma-separated region lengths in bytes.
pub const ENV_REGIONS: &str = "PDSERVE_TRANSFER_PEER_REGIONS";
/// Seed of the region contents.
pub const ENV_SEED: &str = "PDSERVE_TRANSFER_PEER_SEED";
/// Cluster directory holding the member `peer` (needed by `quic`).
pub const ENV_CLUSTER_DIR: &str = "PDSERVE_TRANSFER_PEER_CLUSTER_DIR";
/// Optional `max_registration_bytes`.
pub const ENV_MAX_REG: &str = "PDSERVE_TRANSFER_PEER_MAX_REG";
/// Optional path of a peer executable for the benchmark.
pub const ENV_PEER_EXE: &str = "PDSERVE_TRANSFER_PEER_EXE";
/// Optional session key (64 hex digits): the peer grants it, for every region read and write,
/// to the initiator named by [`ENV_GRANT_PEER`], and then requires keys of every connection.
pub const ENV_SESSION_KEY: &str = "PDSERVE_TRANSFER_PEER_SESSION_KEY";
/// The initiator's name the session key is granted to (default `initiator`).
pub const ENV_GRANT_PEER: &str = "PDSERVE_TRANSFER_PEER_GRANT_TO";
/// Optional `tcp_integrity` of the peer (`none`, `mac`, `encrypt`): the weakest it accepts.
pub const ENV_TCP_INTEGRITY: &str = "PDSERVE_TRANSFER_PEER_TCP_INTEGRITY";
/// Optional threads of the peer engine's I/O runtime (`TransferConfig::io_threads`).
pub const ENV_IO_THREADS: &str = "PDSERVE_TRANSFER_PEER_IO_THREADS";
/// Optional copy threads of the peer engine (`TransferConfig::memcpy_threads`).
pub const ENV_MEMCPY_THREADS: &str = "PDSERVE_TRANSFER_PEER_MEMCPY_THREADS";

/// A session key as [`ENV_SESSION_KEY`] carries it.
pub fn key_to_hex(key: &crate::auth::SessionKey) -> String {
    key.as_bytes().iter().map(|b| format!("{b:02x}")).collect()
}

/// Parses [`key_to_hex`]'s output.
///
/// # Errors
/// [`TransportError::Config`] when it is not 64 hex digits.
pub fn key_from_hex(hex: &str) -> Result<crate::auth::SessionKey> {
    let bad = || TransportError::Config("a session key is 64 hex digits".into());
    if hex.len() != 2 * crate::auth::KEY_BYTES {
        return Err(bad());
    }
    let mut key = [0u8; crate::auth::KEY_BYTES];
    for (i, b) in key.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
    }
    Ok(crate::auth::SessionKey::from_bytes(key))
}

/// The argument a peer process is started with (ignored by the peer itself).
pub const PEER_ARG: &str = "__pdserve-transfer-peer";

/// The member name a peer uses in its cluster directory.
pub const PEER_NODE: &str = "peer";

/// Byte `i` of region `region` for `seed`: a cheap deterministic pattern.
pub fn pattern_byte(seed: u64, region: usize, i: usize) -> u8 {
    let x = (seed ^ ((region as u64) << 56))
        .wrapping_add(i as u64)
        .wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (x >> 56) as u8
}

/// Fills `buf` with the pattern of region `region`.
pub fn fill_pattern(buf: &mut [u8], seed: u64, region: usize) {
    for (i, b) in buf.iter_mut().enumerate() {
        *b = pattern_byte(seed, region, i);
    }
}

/// FNV-1a 64 over several byte slices, in order.
pub fn fnv1a<'a>(parts: impl IntoIterator<Item = &'a [u8]>) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for part in parts {
        for &b in part {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

/// Runs the peer and exits the process if [`ENV_BACKEND`] is set; returns otherwise.
pub fn run_if_requested() {
    if std::env::var_os(ENV_BACKEND).is_some() {
        let code = match run_from_env() {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("transfer peer failed: {e}");
                1
            }
        };
        std::process::exit(code);
    }
}

fn env(name: &str) -> Result<String> {
    std::env::var(name).map_err(|_| TransportError::Config(format!("{name} is not set")))
}

/// A positive count from environment variable `name`, if set.
fn env_count(name: &str) -> Result<Option<usize>> {
    std::env::var(name)
        .ok()
        .map(|s| match s.trim().parse::<usize>() {
            Ok(n) if n > 0 => Ok(n),
            _ => Err(TransportError::Config(format!(
                "{name} must be a positive count, got {s:?}"
            ))),
        })
        .transpose()
}

fn run_from_env() -> Result<()> {
    let backend: BackendKind = env(ENV_BACKEND)?.parse()?;
    let lens: Vec<usize> = env(ENV_REGIONS)?
        .split(',')
        .map(|s| {
            s.trim()
                .parse()
                .map_err(|_| TransportError::Config(format!("bad region length {s:?}")))
        })
        .collect::<Result<_>>()?;
    let seed: u64 = std::env::var(ENV_SEED)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let mut config = TransferConfig::new(backend, "peer");
    config.max_registration_bytes = std::env::var(ENV_MAX_REG).ok().and_then(|s| s.parse().ok());
    if let Ok(dir) = std::env::var(ENV_CLUSTER_DIR) {
        config.credentials = Some(MemberCredentials::load(Path::new(&dir), PEER_NODE)?);
        config.peer_timeout = Duration::from_secs(2);
    }
    if let Ok(mode) = std::env::var(ENV_TCP_INTEGRITY) {
        config.tcp_integrity = mode.parse()?;
    }
    if let Some(n) = env_count(ENV_IO_THREADS)? {
        config.io_threads = n;
    }
    if let Some(n) = env_count(ENV_MEMCPY_THREADS)? {
        config.memcpy_threads = n;
    }
    let engine = TransferEngine::new(config)?;
    let mut regions: Vec<RegisteredRegion> = Vec::new();
    for (i, &len) in lens.iter().enumerate() {
        let r = engine.allocate_and_register(len)?;
        let mut buf = vec![0u8; r.len() as usize];
        fill_pattern(&mut buf, seed, i);
        r.write_at(0, &buf)?;
        regions.push(r);
    }
    let _grant = match std::env::var(ENV_SESSION_KEY) {
        Ok(hex) => Some(
            engine.grant_session(crate::auth::SessionGrant {
                key: key_from_hex(&hex)?,
                peer: std::env::var(ENV_GRANT_PEER).unwrap_or_else(|_| "initiator".into()),
                regions: regions
                    .iter()
                    .map(|r| {
                        crate::auth::RegionGrant::whole(r.id(), crate::auth::Access::ReadWrite)
                    })
                    .collect(),
            })?,
        ),
        Err(_) => None,
    };
    let mut notes = engine
        .take_notifications()
        .ok_or_else(|| TransportError::Config("no notification receiver".into()))?;
    let ids: Vec<String> = regions.iter().map(|r| r.id().to_string()).collect();
    println!("READY {} {}", engine.address(), ids.join(","));
    std::io::stdout().flush()?;
    // Exit when the parent goes away (stdin closes).
    std::thread::spawn(|| {
        let mut sink = String::new();
        while std::io::stdin()
            .lock()
            .read_line(&mut sink)
            .map(|n| n > 0)
            .unwrap_or(false)
        {
            sink.clear();
        }
        std::process::exit(0);
    });
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        while let Some(n) = notes.recv().await {
            match n.bytes.as_slice() {
                b"CHECK" => {
                    let spans: Vec<Vec<u8>> = regions
                        .iter()
                        .map(|r| r.read_at(0, r.len() as usize))
                        .collect::<Result<_>>()?;
                    println!("CHECK {:016x}", fnv1a(spans.iter().map(Vec::as_slice)));
                }
                b"DROP" => {
                    if let Some(r) = regions.pop() {
                        let id = r.id();
                        drop(r); // deregistered before anyone hears of it
                        println!("DROPPED {id}");
                    }
                }
                b"EXIT" => break,
                other => println!("NOTE {}", String::from_utf8_lossy(other)),
            }
            std::io::stdout().flush()?;
        }
        Ok::<_, TransportError>(())
    })?;
    drop(engine);
    Ok(())
}

/// The bytes of a transfer connection's HELLO frame for `backend` from an engine named
/// `name` (for tests that speak the wire protocol by hand).
pub fn hello_frame(backend: BackendKind, name: &str) -> Vec<u8> {
    use crate::backend::{codec, proto};
    let payload = codec::encode_hello(backend.as_str(), name, &proto::host_id());
    let mut frame = codec::ReqHeader::control(codec::OP_HELLO, 0, payload.len())
        .encode()
        .to_vec();
    frame.extend_from_slice(&payload);
    frame
}

/// A running peer process.
#[derive(Debug)]
pub struct PeerProcess {
    child: Child,
    lines: mpsc::Receiver<String>,
    /// The peer engine's address.
    pub address: String,
    /// Its region ids, in order.
    pub regions: Vec<u64>,
    /// Stopped with SIGSTOP ([`PeerProcess::stop`]) and not continued or killed since.
    stopped: bool,
}

impl PeerProcess {
    /// Starts `exe` as a peer and waits (bounded) for its `READY` line.
    ///
    /// # Errors
    /// I/O errors spawning; [`TransportError::Timeout`] when it does not get ready.
    pub fn spawn(
        exe: &Path,
        backend: BackendKind,
        region_lens: &[u64],
        seed: u64,
        cluster_dir: Option<&Path>,
        max_reg: Option<u64>,
        timeout: Duration,
    ) -> Result<Self> {
        Self::spawn_with_env(
            exe,
            backend,
            region_lens,
            seed,
            cluster_dir,
            max_reg,
            timeout,
            &[],
        )
    }

    /// As [`PeerProcess::spawn`], with more environment variables ([`ENV_SESSION_KEY`], ...).
    ///
    /// # Errors
    /// As [`PeerProcess::spawn`].
    #[allow(clippy::too_many_arguments)]
    pub fn spawn_with_env(
        exe: &Path,
        backend: BackendKind,
        region_lens: &[u64],
        seed: u64,
        cluster_dir: Option<&Path>,
        max_reg: Option<u64>,
        timeout: Duration,
        env: &[(&str, String)],
    ) -> Result<Self> {
        let mut cmd = Command::new(exe);
        cmd.envs(env.iter().map(|(k, v)| (*k, v.as_str())));
        // The argument makes an executable without the peer hook exit at once (unknown
        // argument) instead of doing its default work.
        cmd.arg(PEER_ARG)
            .env(ENV_BACKEND, backend.as_str())
            .env(
                ENV_REGIONS,
                region_lens
                    .iter()
                    .map(u64::to_string)
                    .collect::<Vec<_>>()
                    .join(","),
            )
            .env(ENV_SEED, seed.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if let Some(dir) = cluster_dir {
            cmd.env(ENV_CLUSTER_DIR, dir);
        }
        if let Some(m) = max_reg {
            cmd.env(ENV_MAX_REG, m.to_string());
        }
        let mut child = cmd.spawn()?;
        let stdout = child
            .stdout
            .take()
            .ok_or_else(|| TransportError::Config("no peer stdout".into()))?;
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout).lines() {
                match line {
                    Ok(l) => {
                        if tx.send(l).is_err() {
                            break;
                        }
                    }
                    Err(_) => break,
                }
            }
        });
        let mut peer = Self {
            child,
            lines,
            address: String::new(),
            regions: Vec::new(),
            stopped: false,
        };
        let ready = peer.expect_line("READY", timeout)?;
        let mut parts = ready.split_whitespace().skip(1);
        peer.address = parts.next().unwrap_or_default().to_string();
        peer.regions = parts
            .next()
            .unwrap_or_default()
            .split(',')
            .filter_map(|s| s.parse().ok())
            .collect();
        Ok(peer)
    }

    /// Waits (bounded) for the next stdout line starting with `prefix`.
    ///
    /// # Errors
    /// [`TransportError::Timeout`]; [`TransportError::PeerGone`] when the peer exited.
    pub fn expect_line(&self, prefix: &str, timeout: Duration) -> Result<String> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) if line.starts_with(prefix) => return Ok(line),
                Ok(_) => continue,
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    return Err(TransportError::Timeout {
                        what: format!("peer line {prefix:?}"),
                        after: timeout,
                    })
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    return Err(TransportError::peer_gone("peer process", "exited"))
                }
            }
        }
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Kills the process (SIGKILL, which also ends a stopped one) and reaps it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.stopped = false;
    }

    /// Stops the process (SIGSTOP): a peer that neither answers nor acknowledges until
    /// [`PeerProcess::resume`]. Tests use it to make a transfer slow by construction.
    ///
    /// # Errors
    /// The OS error when the signal cannot be sent (the process is gone).
    pub fn stop(&mut self) -> Result<()> {
        self.signal(libc::SIGSTOP)?;
        self.stopped = true;
        Ok(())
    }

    /// Continues a process stopped by [`PeerProcess::stop`] (SIGCONT); a no-op otherwise.
    ///
    /// # Errors
    /// The OS error when the signal cannot be sent.
    pub fn resume(&mut self) -> Result<()> {
        if self.stopped {
            self.signal(libc::SIGCONT)?;
            self.stopped = false;
        }
        Ok(())
    }

    fn signal(&self, sig: libc::c_int) -> Result<()> {
        let pid = libc::pid_t::try_from(self.child.id())
            .map_err(|_| TransportError::Config("peer pid out of range".into()))?;
        // SAFETY: signalling our own child, which is not reaped yet (`kill` reaps and clears
        // `stopped`), so the pid still names it.
        if unsafe { libc::kill(pid, sig) } != 0 {
            return Err(std::io::Error::last_os_error().into());
        }
        Ok(())
    }

    /// The peer executable to use: [`ENV_PEER_EXE`], else `pdserve-transfer-peer` next to the
    /// current executable (or one directory up, for test and bench binaries in `deps/`).
    pub fn find_exe() -> Option<PathBuf> {
        if let Some(p) = std::env::var_os(ENV_PEER_EXE) {
            return Some(PathBuf::from(p));
        }
        let me = std::env::current_exe().ok()?;
        let dir = me.parent()?;
        [
            dir.join("pdserve-transfer-peer"),
            dir.parent()?.join("pdserve-transfer-peer"),
        ]
        .into_iter()
        .find(|p| p.is_file())
    }
}

impl Drop for PeerProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thread_counts_from_the_environment_are_positive_numbers_or_a_clear_error() {
        // A variable of this test alone: other tests never read it.
        const VAR: &str = "PDSERVE_TRANSFER_PEER_TEST_COUNT";
        std::env::remove_var(VAR);
        assert_eq!(env_count(VAR).unwrap(), None);
        std::env::set_var(VAR, " 3 ");
        assert_eq!(env_count(VAR).unwrap(), Some(3));
        for bad in ["0", "-1", "two", ""] {
            std::env::set_var(VAR, bad);
            let e = env_count(VAR).unwrap_err().to_string();
            assert!(
                e.contains(VAR) && e.contains("positive count"),
                "{bad:?}: {e}"
            );
        }
        std::env::remove_var(VAR);
    }
}
