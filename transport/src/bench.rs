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
//! `cpu_s_per_gb` is the CPU time (user + system) both ends spent per GB over the throughput
//! phase's timed windows: this process's `getrusage` plus the peer process's `/proc/PID/stat`
//! (10 ms ticks); `limit_cpu_s_per_gb` the same for the medium's measurement, whose two ends
//! are both in this process. A backend whose GB/s times its CPU-s/GB is near the machine's
//! core count is CPU-bound: it can go no faster on this machine whatever its medium allows.
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
use crate::config::{BackendKind, TcpIntegrity, TransferConfig};
use crate::control::tls::{init_cluster, issue_member, MemberCredentials};
use crate::engine::{BackendAvailability, TransferEngine};
use crate::error::{Result, TransportError};
use crate::op::TransferOp;
use crate::peer::{
    key_to_hex, PeerProcess, ENV_GRANT_PEER, ENV_IO_THREADS, ENV_MEMCPY_THREADS, ENV_SESSION_KEY,
    ENV_TCP_INTEGRITY, PEER_NODE,
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
    /// I/O threads of both engines (`TransferConfig::io_threads`; `None`: the default). On a
    /// machine with more cores, more threads let `tcp`/`quic` connections run in parallel.
    pub io_threads: Option<usize>,
    /// Copy threads of both engines (`TransferConfig::memcpy_threads`; `None`: the default).
    pub memcpy_threads: Option<usize>,
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
            io_threads: None,
            memcpy_threads: None,
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
    /// CPU-seconds both ends spent per GB moved during the throughput phase (user + system
    /// time of this process and of the peer process, over the bytes of the windows measured);
    /// `None` where the peer's time could not be read. Tells a CPU-bound backend from one
    /// waiting on its medium: divide the cores the machine has by it for the most GB/s it can give.
    #[serde(default)]
    pub cpu_s_per_gb: Option<f64>,
    /// The same for the bare medium's measurement (both ends run in this process).
    #[serde(default)]
    pub limit_cpu_s_per_gb: Option<f64>,
}

fn write_op() -> String {
    "write".into()
}

/// Transfers kept in flight when measuring throughput.
pub const WINDOW: usize = 8;

impl TransferBenchOptions {
    /// The thread counts asked for, on an engine configuration.
    fn apply_threads(&self, cfg: &mut TransferConfig) {
        if let Some(n) = self.io_threads {
            cfg.io_threads = n;
        }
        if let Some(n) = self.memcpy_threads {
            cfg.memcpy_threads = n;
        }
    }

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

/// CPU time (user + system) this process has used so far.
fn own_cpu() -> Option<Duration> {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: `usage` is a valid rusage for the call to fill.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr()) } != 0 {
        return None;
    }
    // SAFETY: getrusage succeeded and filled it.
    let usage = unsafe { usage.assume_init() };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    Some(tv(usage.ru_utime) + tv(usage.ru_stime))
}

/// CPU time (user + system) process `pid` has used so far, from `/proc/PID/stat`.
fn process_cpu(pid: u32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the parenthesised command name; utime and stime are the 12th and 13th.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    (hz > 0).then(|| Duration::from_secs_f64(ticks as f64 / hz as f64))
}

/// CPU time of both ends of a transfer: this process, plus the peer's when it is another one.
fn both_ends_cpu(peer: Option<u32>) -> Option<Duration> {
    Some(own_cpu()? + peer.map_or(Some(Duration::ZERO), process_cpu)?)
}

fn measure(
    size: u64,
    opts: &TransferBenchOptions,
    once: impl FnMut() -> Result<()>,
) -> Result<Timing> {
    measure_cpu(size, opts, None, once).map(|(t, _)| t)
}

/// As [`measure`], also returning the CPU-seconds per GB both ends spent over the timed
/// repetitions (`None` where a clock could not be read). `peer`: the peer process, if any.
fn measure_cpu(
    size: u64,
    opts: &TransferBenchOptions,
    peer: Option<u32>,
    mut once: impl FnMut() -> Result<()>,
) -> Result<(Timing, Option<f64>)> {
    once()?; // warm-up
    let cpu_before = both_ends_cpu(peer);
    let mut samples = Vec::new();
    let start = Instant::now();
    while samples.len() < opts.max_iterations.max(3)
        && (samples.len() < 3 || start.elapsed() < opts.max_time)
    {
        let t = Instant::now();
        once()?;
        samples.push(t.elapsed());
    }
    let cpu = cpu_before.zip(both_ends_cpu(peer)).map(|(a, b)| {
        b.saturating_sub(a).as_secs_f64() / (size as f64 * samples.len() as f64 / 1e9)
    });
    samples.sort();
    let median = samples[samples.len() / 2].as_secs_f64();
    // Median-based: robust to other processes sharing this machine's cores; the limit is
    // measured the same way, so the ratio compares like with like.
    Ok((
        Timing {
            gbps: size as f64 / median / 1e9,
            median_us: median * 1e6,
        },
        cpu,
    ))
}

/// A medium's limit: GB/s and CPU-seconds per GB.
type Limit = (f64, Option<f64>);

fn memcpy_limit(size: u64, opts: &TransferBenchOptions) -> Result<Limit> {
    let src = pdserve_runtime::memory::AnonMemory::new(size as usize)?;
    // One destination slot per transfer of the window, as the backends write them.
    let dst = pdserve_runtime::memory::AnonMemory::new(size as usize * WINDOW)?;
    use pdserve_runtime::memory::HostMemory;
    // SAFETY: `src` holds `size` bytes (rounded up to a page); `dst` WINDOW times that.
    let fill = unsafe { std::slice::from_raw_parts_mut(src.as_ptr(), size as usize) };
    fill.iter_mut().enumerate().for_each(|(i, b)| *b = i as u8);
    let (t, cpu) = measure_cpu(size * WINDOW as u64, opts, None, || {
        for slot in 0..WINDOW {
            // SAFETY: as above; slot `slot` of `dst` is in bounds and apart from `src`.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    src.as_ptr(),
                    dst.as_ptr().add(slot * size as usize),
                    size as usize,
                )
            };
            std::hint::black_box(dst.as_ptr());
        }
        Ok(())
    })?;
    Ok((t.gbps, cpu))
}

fn socket_limit(size: u64, opts: &TransferBenchOptions) -> Result<Limit> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let server = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut s, _) = listener.accept()?;
        s.set_nodelay(true)?;
        // One slot per message of the window, as the backends' targets land them.
        let mut buf = vec![0u8; size as usize * WINDOW];
        for slot in (0..WINDOW).cycle() {
            let slot = &mut buf[slot * size as usize..][..size as usize];
            match s.read_exact(slot) {
                Ok(()) => s.write_all(&[1])?,
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
                Err(e) => return Err(e),
            }
        }
        Ok(())
    });
    let mut c = TcpStream::connect(addr)?;
    c.set_nodelay(true)?;
    let data = vec![7u8; size as usize];
    let mut ack = [0u8; 1];
    let (t, cpu) = measure_cpu(size * WINDOW as u64, opts, None, || {
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
    Ok((t.gbps, cpu))
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

impl BenchPeer {
    /// The peer's process id, when it runs in a process of its own.
    fn pid(&self) -> Option<u32> {
        match self {
            BenchPeer::Process(p) => Some(p.pid()),
            BenchPeer::InProcess(..) => None,
        }
    }
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
    if let Some(n) = opts.io_threads {
        env.push((ENV_IO_THREADS, n.to_string()));
    }
    if let Some(n) = opts.memcpy_threads {
        env.push((ENV_MEMCPY_THREADS, n.to_string()));
    }
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
    opts.apply_threads(&mut cfg);
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
    opts.apply_threads(&mut cfg);
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
        let (t, cpu_s_per_gb) = measure_cpu(size * WINDOW as u64, opts, peer.pid(), || {
            wait(
                (0..WINDOW)
                    .map(|slot| session.submit(&[op(slot)]))
                    .collect::<Result<_>>()?,
            )
        })?;
        let (limit, limit_cpu_s_per_gb) = match backend {
            BackendKind::Local | BackendKind::Shm => memcpy_limit(size, opts)?,
            BackendKind::Tcp | BackendKind::Quic => socket_limit(size, opts)?,
            // No medium baseline is measured for RDMA (no device here); see docs/transport.md.
            BackendKind::Rdma => (f64::NAN, None),
        };
        rows.push(TransferBenchRow {
            auth,
            backend: label.clone(),
            op: if opts.reads { "read" } else { "write" }.into(),
            size_bytes: size,
            gbps: t.gbps,
            limit_gbps: limit,
            latency_us: lat.median_us,
            cpu_s_per_gb,
            limit_cpu_s_per_gb,
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
        "{:<12} {:<5} {:<6} {:>10} {:>10} {:>12} {:>8} {:>12} {:>10} {:>10}",
        "backend",
        "auth",
        "op",
        "size",
        "GB/s",
        "limit GB/s",
        "ratio",
        "latency µs",
        "CPU-s/GB",
        "limit's"
    );
    let cpu = |c: Option<f64>| c.map_or("-".to_string(), |c| format!("{c:.3}"));
    for r in rows {
        println!(
            "{:<12} {:<5} {:<6} {:>10} {:>10.2} {:>12.2} {:>8.2} {:>12.1} {:>10} {:>10}",
            r.backend,
            if r.auth { "key" } else { "-" },
            r.op,
            human(r.size_bytes),
            r.gbps,
            r.limit_gbps,
            r.gbps / r.limit_gbps,
            r.latency_us,
            cpu(r.cpu_s_per_gb),
            cpu(r.limit_cpu_s_per_gb)
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Burns about `d` of CPU time on this thread.
    fn burn(d: Duration) {
        let start = own_cpu().unwrap();
        let mut x = 1u64;
        while own_cpu().unwrap() - start < d {
            for i in 0..100_000u64 {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(i);
            }
            std::hint::black_box(x);
        }
    }

    #[test]
    fn both_clocks_read_the_cpu_time_this_process_spends() {
        let pid = std::process::id();
        let (own0, proc0) = (own_cpu().unwrap(), process_cpu(pid).unwrap());
        burn(Duration::from_millis(200));
        let (own1, proc1) = (own_cpu().unwrap(), process_cpu(pid).unwrap());
        let own = (own1 - own0).as_secs_f64();
        let procfs = proc1.as_secs_f64() - proc0.as_secs_f64();
        assert!(own >= 0.2, "getrusage advanced {own} s");
        // /proc counts in clock ticks (10 ms here): allow a few of them.
        assert!(
            (procfs - own).abs() < 0.05,
            "/proc {procfs} s vs getrusage {own} s"
        );
        assert_eq!(process_cpu(u32::MAX), None, "no such process");
    }

    #[test]
    fn rows_carry_the_cpu_both_ends_spent_per_gb() {
        let opts = TransferBenchOptions {
            backends: vec![BackendKind::Local],
            sizes: vec![1 << 20],
            max_iterations: 200,
            max_time: Duration::from_millis(200),
            io_threads: Some(1),
            memcpy_threads: Some(3),
            ..Default::default()
        };
        let rows = run_transfer_bench(&opts).unwrap();
        assert_eq!(rows.len(), 1);
        let r = &rows[0];
        // Moving a GB takes at least a memcpy's time and, on any machine, far less than a
        // minute of CPU.
        for (what, cpu) in [("backend", r.cpu_s_per_gb), ("limit", r.limit_cpu_s_per_gb)] {
            let cpu = cpu.unwrap_or_else(|| panic!("{what}: no CPU time"));
            assert!(cpu > 0.001 && cpu < 60.0, "{what}: {cpu} CPU-s/GB");
        }
    }
}
