//! `pdserve bench transfer`: throughput and latency of each backend beside the raw limit of its
//! medium, measured in the same run.
//!
//! For each backend and size: `latency_us` is the median time of one write (or, with
//! `reads`, one read: what a decode instance does in pull mode) of `size` bytes alone, from
//! submit to completion; `gbps` is the sustained rate with [`WINDOW`] of them in flight (`WINDOW * size` over the median time of such a window). The limit is
//! measured the same way on the bare medium: a plain single-threaded `memcpy` of `size` bytes,
//! `WINDOW` times, for `local`/`shm`; for `tcp`/`quic` a plain TCP socket pair on loopback
//! (`WINDOW` messages of `size` bytes streamed, the receiver answering one byte per message).
//! Medians make the numbers robust to other processes sharing the cores.
//!
//! Placement: the peer engine runs in a second process (`pdserve-transfer-peer`, or this
//! executable re-run as a peer when its `main` calls [`crate::peer::run_if_requested`]); if
//! neither can be started, the peer runs in this process and the table says so. The socket
//! baseline's receiver is a thread of this process. Call from outside any async runtime (the
//! function runs its own), e.g. inside `spawn_blocking`.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::auth::{Access, RegionGrant, SessionCredentials, SessionGrant, SessionKey};
use crate::control::tls::{init_cluster, issue_member, MemberCredentials};
use crate::engine::{
    BackendAvailability, BackendKind, TcpIntegrity, TransferConfig, TransferEngine, TransferOp,
};
use crate::error::{Result, TransportError};
use crate::peer::{
    key_to_hex, PeerProcess, ENV_GRANT_PEER, ENV_SESSION_KEY, ENV_TCP_INTEGRITY, PEER_NODE,
};

/// The initiator's engine name in the benchmark (and the node its grant names).
const BENCH_NODE: &str = "bench";

/// What to measure.
#[derive(Debug, Clone)]
pub struct TransferBenchOptions {
    /// Backends to run (default: every one runnable here).
    pub backends: Vec<BackendKind>,
    /// Transfer sizes in bytes (default 4 KiB, 64 KiB, 1 MiB, 16 MiB, 64 MiB).
    pub sizes: Vec<u64>,
    /// Most repetitions per (backend, size).
    pub max_iterations: usize,
    /// Most time per (backend, size) after the first repetition.
    pub max_time: Duration,
    /// Peer executable (default: [`PeerProcess::find_exe`], then this executable).
    pub peer_exe: Option<PathBuf>,
    /// Measure reads from the peer instead of writes to it.
    pub reads: bool,
    /// Authenticated sessions (every backend but `local`): the peer grants a session key and
    /// the bench connects with it, as a deployment does.
    pub auth: bool,
    /// Frame protections to measure `tcp` with (one set of rows each; needs `auth`).
    pub tcp_integrity: Vec<TcpIntegrity>,
}

impl Default for TransferBenchOptions {
    fn default() -> Self {
        Self {
            backends: BackendKind::ALL
                .into_iter()
                .filter(|b| b.is_available())
                .collect(),
            sizes: vec![4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20],
            max_iterations: 2000,
            max_time: Duration::from_millis(700),
            peer_exe: None,
            reads: false,
            auth: true,
            tcp_integrity: vec![TcpIntegrity::None, TcpIntegrity::Mac, TcpIntegrity::Encrypt],
        }
    }
}

/// One measured row (the `--json` output is a list of these).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TransferBenchRow {
    /// Backend name.
    pub backend: String,
    /// `write` or `read`.
    #[serde(default = "write_op")]
    pub op: String,
    /// Bytes per transfer.
    pub size_bytes: u64,
    /// Throughput of the backend, GB/s (10^9 bytes per second).
    pub gbps: f64,
    /// Throughput of the bare medium in the same run, GB/s.
    pub limit_gbps: f64,
    /// Median time of one transfer, microseconds.
    pub latency_us: f64,
    /// Whether the session proved a session key (and ops were checked against a grant).
    #[serde(default)]
    pub auth: bool,
}

fn write_op() -> String {
    "write".into()
}

/// Transfers kept in flight when measuring throughput.
pub const WINDOW: usize = 8;

impl TransferBenchOptions {
    fn latency_phase(&self) -> Self {
        Self {
            max_time: self.max_time / 2,
            ..self.clone()
        }
    }
}

struct Timing {
    gbps: f64,
    median_us: f64,
}

fn measure(
    size: u64,
    opts: &TransferBenchOptions,
    mut once: impl FnMut() -> Result<()>,
) -> Result<Timing> {
    once()?; // warm-up
    let mut samples = Vec::new();
    let start = Instant::now();
    while samples.len() < opts.max_iterations.max(3)
        && (samples.len() < 3 || start.elapsed() < opts.max_time)
    {
        let t = Instant::now();
        once()?;
        samples.push(t.elapsed());
    }
    samples.sort();
    let median = samples[samples.len() / 2].as_secs_f64();
    // Median-based: robust to other processes sharing this machine's cores; the limit is
    // measured the same way, so the ratio compares like with like.
    Ok(Timing {
        gbps: size as f64 / median / 1e9,
        median_us: median * 1e6,
    })
}

fn memcpy_limit(size: u64, opts: &TransferBenchOptions) -> Result<f64> {
    let src = pdserve_runtime::memory::AnonMemory::new(size as usize)?;
    let dst = pdserve_runtime::memory::AnonMemory::new(size as usize)?;
    use pdserve_runtime::memory::HostMemory;
    // SAFETY: both mappings hold `size` bytes (rounded up to a page) and do not overlap.
    let fill = unsafe { std::slice::from_raw_parts_mut(src.as_ptr(), size as usize) };
    fill.iter_mut().enumerate().for_each(|(i, b)| *b = i as u8);
    Ok(measure(size * WINDOW as u64, opts, || {
        for _ in 0..WINDOW {
            // SAFETY: as above.
            unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst.as_ptr(), size as usize) };
            std::hint::black_box(dst.as_ptr());
        }
        Ok(())
    })?
    .gbps)
}

fn socket_limit(size: u64, opts: &TransferBenchOptions) -> Result<f64> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let server = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut s, _) = listener.accept()?;
        s.set_nodelay(true)?;
        let mut buf = vec![0u8; size as usize];
        loop {
            match s.read_exact(&mut buf) {
                Ok(()) => s.write_all(&[1])?,
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
                Err(e) => return Err(e),
            }
        }
    });
    let mut c = TcpStream::connect(addr)?;
    c.set_nodelay(true)?;
    let data = vec![7u8; size as usize];
    let mut ack = [0u8; 1];
    let t = measure(size * WINDOW as u64, opts, || {
        for _ in 0..WINDOW {
            c.write_all(&data)?;
        }
        for _ in 0..WINDOW {
            c.read_exact(&mut ack)?;
        }
        Ok(())
    })?;
    drop(c);
    let _ = server.join();
    Ok(t.gbps)
}

/// A scratch cluster directory for the `quic` peer (removed on drop).
struct ScratchCluster(PathBuf);

impl ScratchCluster {
    fn new() -> Result<Self> {
        let dir =
            std::env::temp_dir().join(format!("pdserve-bench-cluster-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        init_cluster(&dir, "bench")?;
        issue_member(&dir, PEER_NODE)?;
        issue_member(&dir, "bench")?;
        Ok(Self(dir))
    }
}

impl Drop for ScratchCluster {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Held for its `Drop` (kills the process / shuts the engine down).
#[allow(dead_code)]
enum BenchPeer {
    Process(PeerProcess),
    InProcess(
        TransferEngine,
        crate::memory::RegisteredRegion,
        Option<crate::auth::SessionGrantGuard>,
    ),
}

/// How the bench session is secured.
struct Security {
    key: Option<SessionKey>,
    integrity: TcpIntegrity,
}

fn start_peer(
    backend: BackendKind,
    len: u64,
    opts: &TransferBenchOptions,
    cluster: Option<&ScratchCluster>,
    sec: &Security,
) -> Result<(BenchPeer, String, u64, String)> {
    let mut env: Vec<(&str, String)> = vec![(ENV_TCP_INTEGRITY, integrity_name(sec.integrity))];
    if let Some(key) = &sec.key {
        env.push((ENV_SESSION_KEY, key_to_hex(key)));
        env.push((ENV_GRANT_PEER, BENCH_NODE.to_string()));
    }
    let candidates: Vec<PathBuf> = opts
        .peer_exe
        .clone()
        .into_iter()
        .chain(PeerProcess::find_exe())
        .chain(std::env::current_exe().ok())
        .collect();
    if backend != BackendKind::Local {
        for exe in candidates {
            let dir = cluster.map(|c| c.0.as_path());
            match PeerProcess::spawn_with_env(
                &exe,
                backend,
                &[len],
                1,
                dir,
                None,
                Duration::from_secs(5),
                &env,
            ) {
                Ok(p) => {
                    let (addr, id) = (p.address.clone(), p.regions.first().copied().unwrap_or(0));
                    let placement = format!(
                        "peer in a second process (pid {}, {})",
                        p.pid(),
                        exe.display()
                    );
                    return Ok((BenchPeer::Process(p), addr, id, placement));
                }
                Err(e) => {
                    tracing::debug!(exe = %exe.display(), error = %e, "bench peer did not start")
                }
            }
        }
    }
    let mut cfg = TransferConfig::new(backend, PEER_NODE);
    if let Some(c) = cluster {
        cfg.credentials = Some(MemberCredentials::load(&c.0, PEER_NODE)?);
    }
    cfg.tcp_integrity = sec.integrity;
    let engine = TransferEngine::new(cfg)?;
    let region = engine.allocate_and_register(len as usize)?;
    let grant = match &sec.key {
        Some(key) => Some(engine.grant_session(SessionGrant {
            key: key.clone(),
            peer: BENCH_NODE.into(),
            regions: vec![RegionGrant::whole(region.id(), Access::ReadWrite)],
        })?),
        None => None,
    };
    let (addr, id) = (engine.address(), region.id());
    let placement = if backend == BackendKind::Local {
        "both engines in this process (the local backend's design)".to_string()
    } else {
        "FALLBACK: peer engine in this process (no peer executable could be started)".to_string()
    };
    Ok((
        BenchPeer::InProcess(engine, region, grant),
        addr,
        id,
        placement,
    ))
}

fn integrity_name(i: TcpIntegrity) -> String {
    match i {
        TcpIntegrity::None => "none",
        TcpIntegrity::Mac => "mac",
        TcpIntegrity::Encrypt => "encrypt",
    }
    .to_string()
}

fn bench_backend(
    backend: BackendKind,
    integrity: TcpIntegrity,
    opts: &TransferBenchOptions,
    rows: &mut Vec<TransferBenchRow>,
    placements: &mut Vec<String>,
) -> Result<()> {
    let max = opts.sizes.iter().copied().max().unwrap_or(4096);
    let cluster = if backend == BackendKind::Quic {
        Some(ScratchCluster::new()?)
    } else {
        None
    };
    let auth = opts.auth && backend != BackendKind::Local;
    let sec = Security {
        key: auth.then(SessionKey::generate).transpose()?,
        integrity,
    };
    let label = match integrity {
        TcpIntegrity::None => backend.to_string(),
        other => format!("{backend}+{}", integrity_name(other)),
    };
    // Transfers in flight go to disjoint slots of the peer's region: concurrent writes into the
    // same bytes are undefined (and fail their tags under tcp_integrity, which checks after
    // landing).
    let (peer, addr, remote_id, placement) =
        start_peer(backend, max * WINDOW as u64, opts, cluster.as_ref(), &sec)?;
    placements.push(format!("{label}: {placement}"));
    let mut cfg = TransferConfig::new(backend, BENCH_NODE);
    cfg.peer_timeout = Duration::from_secs(10);
    cfg.tcp_integrity = integrity;
    if let Some(c) = &cluster {
        cfg.credentials = Some(MemberCredentials::load(&c.0, BENCH_NODE)?);
    }
    let engine = TransferEngine::new(cfg)?;
    let local = engine.allocate_and_register(max as usize)?;
    local.write_at(0, &vec![0x3Cu8; max as usize])?;
    let session = match &sec.key {
        Some(key) => {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            rt.block_on(engine.connect_with(&addr, SessionCredentials { key: key.clone() }))?
        }
        None => engine.connect_blocking(&addr)?,
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    for &size in &opts.sizes {
        let op = |slot: usize| {
            let remote = slot as u64 * size;
            if opts.reads {
                TransferOp::read(local.id(), 0, remote_id, remote, size)
            } else {
                TransferOp::write(local.id(), 0, remote_id, remote, size)
            }
        };
        let wait = |handles: Vec<crate::BatchHandle>| -> Result<()> {
            rt.block_on(async {
                // Newest first: one wake-up for the window instead of one per transfer.
                for h in handles.iter().rev() {
                    h.wait(Duration::from_secs(60)).await?;
                }
                Ok(())
            })
        };
        // Latency: one transfer alone, submit to completion.
        let lat = measure(size, &opts.latency_phase(), || {
            wait(vec![session.submit(&[op(0)])?])
        })?;
        // Throughput: WINDOW transfers in flight, as a sender streaming KV blocks keeps them.
        let t = measure(size * WINDOW as u64, opts, || {
            wait(
                (0..WINDOW)
                    .map(|slot| session.submit(&[op(slot)]))
                    .collect::<Result<_>>()?,
            )
        })?;
        let limit = match backend {
            BackendKind::Local | BackendKind::Shm => memcpy_limit(size, opts)?,
            BackendKind::Tcp | BackendKind::Quic => socket_limit(size, opts)?,
            // No medium baseline is measured for RDMA (no device here); see docs/transport.md.
            BackendKind::Rdma => f64::NAN,
        };
        rows.push(TransferBenchRow {
            auth,
            backend: label.clone(),
            op: if opts.reads { "read" } else { "write" }.into(),
            size_bytes: size,
            gbps: t.gbps,
            limit_gbps: limit,
            latency_us: lat.median_us,
        });
    }
    drop(session);
    drop(engine);
    drop(peer);
    Ok(())
}

/// Runs the benchmark; also returns, through the log and [`print_table`]'s caller, where the
/// peers ran (see [`run_transfer_bench_with_placement`]).
///
/// # Errors
/// The first engine or I/O error.
pub fn run_transfer_bench(opts: &TransferBenchOptions) -> Result<Vec<TransferBenchRow>> {
    run_transfer_bench_with_placement(opts).map(|(rows, _)| rows)
}

/// As [`run_transfer_bench`], also returning one line per backend saying where its peer ran.
///
/// # Errors
/// The first engine or I/O error.
pub fn run_transfer_bench_with_placement(
    opts: &TransferBenchOptions,
) -> Result<(Vec<TransferBenchRow>, Vec<String>)> {
    for b in &opts.backends {
        if !b.is_available() {
            return Err(TransportError::Unsupported(format!(
                "backend {b} cannot run here"
            )));
        }
    }
    let opts = opts.clone();
    // Own thread: the bench builds runtimes and blocks, which must not happen on a runtime thread.
    std::thread::Builder::new()
        .name("pdserve-bench-transfer".into())
        .spawn(move || {
            let mut rows = Vec::new();
            let mut placements = Vec::new();
            for &b in &opts.backends {
                let modes = if b == BackendKind::Tcp && opts.auth {
                    opts.tcp_integrity.clone()
                } else {
                    vec![TcpIntegrity::None]
                };
                for integrity in modes {
                    bench_backend(b, integrity, &opts, &mut rows, &mut placements)?;
                }
            }
            Ok((rows, placements))
        })?
        .join()
        .map_err(|_| TransportError::Config("transfer bench thread panicked".into()))?
}

fn human(size: u64) -> String {
    match size {
        s if s >= 1 << 20 && s % (1 << 20) == 0 => format!("{} MiB", s >> 20),
        s if s >= 1 << 10 && s % (1 << 10) == 0 => format!("{} KiB", s >> 10),
        s => format!("{s} B"),
    }
}

/// Prints the rows as a table.
pub fn print_table(rows: &[TransferBenchRow]) {
    println!(
        "{:<12} {:<5} {:<6} {:>10} {:>10} {:>12} {:>8} {:>12}",
        "backend", "auth", "op", "size", "GB/s", "limit GB/s", "ratio", "latency µs"
    );
    for r in rows {
        println!(
            "{:<12} {:<5} {:<6} {:>10} {:>10.2} {:>12.2} {:>8.2} {:>12.1}",
            r.backend,
            if r.auth { "key" } else { "-" },
            r.op,
            human(r.size_bytes),
            r.gbps,
            r.limit_gbps,
            r.gbps / r.limit_gbps,
            r.latency_us
        );
    }
}
