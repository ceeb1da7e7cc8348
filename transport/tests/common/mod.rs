//! Shared helpers of the transport integration tests: a peer that is either another process
//! (`shm`, `tcp`, `quic`) or another engine in this process (`local`), with the same commands.

#![allow(dead_code)]

use std::path::PathBuf;
use std::time::{Duration, Instant};

use pdserve_transport::control::tls::{init_cluster, issue_member, MemberCredentials};
use pdserve_transport::peer::{fill_pattern, fnv1a, PeerProcess, PEER_NODE};
use pdserve_transport::{
    BackendKind, CopyHold, Notification, RegisteredRegion, TransferConfig, TransferEngine,
};

pub const PEER_EXE: &str = env!("CARGO_BIN_EXE_pdserve-transfer-peer");
pub const STEP: Duration = Duration::from_secs(10);

/// A cluster directory with members `peer` and `initiator`.
pub struct Cluster {
    pub dir: tempfile::TempDir,
}

impl Cluster {
    pub fn new(name: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        init_cluster(dir.path(), name).unwrap();
        issue_member(dir.path(), PEER_NODE).unwrap();
        issue_member(dir.path(), "initiator").unwrap();
        Self { dir }
    }
    pub fn member(&self, node: &str) -> MemberCredentials {
        MemberCredentials::load(self.dir.path(), node).unwrap()
    }
    pub fn path(&self) -> PathBuf {
        self.dir.path().to_path_buf()
    }
}

pub enum Peer {
    Process(PeerProcess),
    InProcess {
        engine: Option<TransferEngine>,
        regions: Vec<RegisteredRegion>,
        notes: tokio::sync::mpsc::Receiver<Notification>,
        address: String,
    },
}

pub fn engine_config(
    backend: BackendKind,
    name: &str,
    cluster: Option<&Cluster>,
    max_reg: Option<u64>,
) -> TransferConfig {
    let mut c = TransferConfig::new(backend, name);
    c.max_registration_bytes = max_reg;
    c.peer_timeout = Duration::from_secs(2);
    if let Some(cl) = cluster {
        c.credentials = Some(cl.member(if name == PEER_NODE {
            PEER_NODE
        } else {
            "initiator"
        }));
    }
    c
}

impl Peer {
    pub fn start(
        backend: BackendKind,
        lens: &[u64],
        seed: u64,
        cluster: Option<&Cluster>,
        max_reg: Option<u64>,
    ) -> Self {
        if backend == BackendKind::Local {
            let engine =
                TransferEngine::new(engine_config(backend, PEER_NODE, cluster, max_reg)).unwrap();
            let regions: Vec<_> = lens
                .iter()
                .enumerate()
                .map(|(i, &len)| {
                    let r = engine.allocate_and_register(len as usize).unwrap();
                    let mut buf = vec![0u8; len as usize];
                    fill_pattern(&mut buf, seed, i);
                    r.write_at(0, &buf).unwrap();
                    r
                })
                .collect();
            let notes = engine.take_notifications().unwrap();
            let address = engine.address();
            Peer::InProcess {
                engine: Some(engine),
                regions,
                notes,
                address,
            }
        } else {
            let dir = cluster.map(Cluster::path);
            Peer::Process(
                PeerProcess::spawn(
                    std::path::Path::new(PEER_EXE),
                    backend,
                    lens,
                    seed,
                    dir.as_deref(),
                    max_reg,
                    STEP,
                )
                .unwrap(),
            )
        }
    }

    pub fn address(&self) -> String {
        match self {
            Peer::Process(p) => p.address.clone(),
            Peer::InProcess { address, .. } => address.clone(),
        }
    }

    pub fn region_ids(&self) -> Vec<u64> {
        match self {
            Peer::Process(p) => p.regions.clone(),
            Peer::InProcess { regions, .. } => regions.iter().map(|r| r.id()).collect(),
        }
    }

    /// Sends `CHECK` through the session and returns the hash of the peer's regions as the
    /// peer itself sees them after receiving the notification.
    pub async fn check(&mut self, session: &pdserve_transport::Session) -> u64 {
        session.notify(b"CHECK").await.unwrap();
        match self {
            Peer::Process(p) => {
                let line = tokio::task::block_in_place(|| p.expect_line("CHECK", STEP)).unwrap();
                u64::from_str_radix(line.split_whitespace().nth(1).unwrap(), 16).unwrap()
            }
            Peer::InProcess { regions, notes, .. } => {
                let n = tokio::time::timeout(STEP, notes.recv())
                    .await
                    .unwrap()
                    .unwrap();
                assert_eq!(n.bytes, b"CHECK");
                assert_eq!(n.from, "initiator");
                let spans: Vec<Vec<u8>> = regions
                    .iter()
                    .map(|r| r.read_at(0, r.len() as usize).unwrap())
                    .collect();
                fnv1a(spans.iter().map(Vec::as_slice))
            }
        }
    }

    /// Deregisters the peer's last region.
    pub async fn drop_last_region(&mut self, session: &pdserve_transport::Session) {
        match self {
            Peer::Process(p) => {
                session.notify(b"DROP").await.unwrap();
                tokio::task::block_in_place(|| p.expect_line("DROPPED", STEP)).unwrap();
            }
            Peer::InProcess { regions, .. } => {
                regions.pop();
            }
        }
    }

    /// Keeps transfers between `initiator` and this peer from moving until
    /// [`Peer::unstall`]: the initiator's copy threads are held where the initiator copies
    /// the bytes itself (`local`, `shm`); otherwise the peer process is stopped (SIGSTOP), so
    /// it neither answers reads nor acknowledges writes. A transfer made slow by
    /// construction, whatever the machine's speed. (One-sided RDMA moves bytes without the
    /// peer's CPU: a stopped peer does not stall it.)
    pub fn stall(&mut self, initiator: &TransferEngine) -> Stall {
        if let Ok(hold) = initiator.hold_copies() {
            return Stall::Copies(hold);
        }
        match self {
            Peer::Process(p) => {
                p.stop().unwrap();
                Stall::PeerStopped
            }
            Peer::InProcess { .. } => panic!("an in-process peer is only used with `local`"),
        }
    }

    /// Lets a stalled transfer move again.
    pub fn unstall(&mut self, stall: Stall) {
        match stall {
            Stall::Copies(hold) => drop(hold),
            Stall::PeerStopped => {
                if let Peer::Process(p) = self {
                    p.resume().unwrap();
                }
            }
        }
    }

    /// Kills the peer (SIGKILL for a process, stalled or not; dropping the engine
    /// in-process).
    pub fn kill(&mut self) {
        match self {
            Peer::Process(p) => p.kill(),
            Peer::InProcess {
                engine, regions, ..
            } => {
                // The engine goes first, as everything goes at once when a process dies:
                // dropping the regions first would let an in-flight copy see a live peer
                // whose region was just deregistered (a correct `UnknownRegion`, but not
                // the death this models).
                engine.take();
                regions.clear();
            }
        }
    }
}

/// What [`Peer::stall`] did; give it back to [`Peer::unstall`].
#[must_use = "hand it to Peer::unstall"]
pub enum Stall {
    Copies(CopyHold),
    PeerStopped,
}

/// Polls `cond` until true or the deadline; returns whether it became true.
pub async fn wait_until(timeout: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if cond() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    cond()
}
