//! `pdserve launch`: a single-node P/D cluster — a proxy, N prefill and M decode instances
//! (and, for a vision-language model, `--encode K` encode instances: E/P/D),
//! each a child process this launcher supervises (restart on crash under a budget, then stop
//! everything), with the proxy URL printed on a line of its own. Ctrl-C or SIGTERM **drains**
//! the cluster: every instance gets SIGTERM first (each leaves the routing set, finishes what
//! it runs within `--drain-timeout`, and exits), the proxy last, so requests in flight
//! complete; a child still there after the drain bound plus a grace period is killed.
//! Children also get SIGTERM if the launcher itself dies (`PR_SET_PDEATHSIG`), so none is left
//! behind. A child that exits 0 by itself was drained (`pdserve drain`): it is not restarted.
//!
//! **Scaling.** The launcher listens on a Unix socket in its credentials directory
//! (`DIR/launch.sock`, reachable only by its user); `pdserve scale prefill|decode N
//! --credentials-dir DIR` sends `scale ROLE N` there: the launcher starts new instances
//! (they register with the proxy and are routed to as soon as they are up) or drains the
//! newest ones (SIGTERM: they leave routing at once and finish what they run).
//! `--in-process` runs every actor in this process over the `local` transport instead.
//!
//! The launcher makes ephemeral cluster credentials in a private temporary directory (removed
//! when it exits): the proxy gets a control-plane address, every instance registers there and
//! heartbeats (registration is what keeps routing alive; no static URL list is given), and
//! the launcher prints `inspect: pdserve inspect ADDR --credentials-dir DIR` on the line after
//! the proxy URL (it also writes ADDR to `DIR/proxy-control-addr`).

use anyhow::{bail, Context, Result};
use clap::Args;
use pdserve_runtime::supervision::{RestartDecision, RestartPolicy, RestartTracker};
use std::net::{SocketAddr, TcpListener, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};
use tokio::process::{Child, Command};

/// How long an instance may take to load and answer `/health`.
const READY_TIMEOUT: Duration = Duration::from_secs(300);
/// Grace period beyond the drain timeout between SIGTERM and SIGKILL at shutdown.
const STOP_GRACE: Duration = Duration::from_secs(10);
/// The launcher's control socket in its credentials directory (`pdserve scale`).
pub const CONTROL_SOCKET: &str = "launch.sock";

/// `pdserve launch` flags.
#[derive(Args, Debug, Clone)]
pub struct LaunchArgs {
    /// `default`, a GGUF file, an HF directory, or `synthetic:NAME`.
    #[arg(long, default_value = "default")]
    model: String,
    /// A vision-language model's vision tower for every instance (`model.mmproj`): an
    /// `mmproj` GGUF beside the decoder's GGUF.
    #[arg(long)]
    mmproj: Option<String>,
    /// Names every instance serves the model under (one or more aliases, as vLLM's flag;
    /// each instance's `model.name`): requests naming any of them are routed and accepted.
    #[arg(long, num_args = 1..)]
    served_model_name: Vec<String>,
    /// Prefill instances.
    #[arg(long, default_value_t = 1)]
    prefill: usize,
    /// Decode instances.
    #[arg(long, default_value_t = 1)]
    decode: usize,
    /// Encode instances (E/P/D, a vision-language model): requests with images are encoded
    /// there first, and prefill takes the embeddings over the transfer engine.
    #[arg(long, default_value_t = 0)]
    encode: usize,
    /// Tensor-parallel ranks per instance.
    #[arg(long, default_value_t = 1)]
    tp: usize,
    /// Where every instance's ranks run (`model.device`): cpu, cuda or cuda:N (a binary built
    /// with `--features cuda` and an NVIDIA driver; checked before anything starts). On one
    /// GPU, prefill and decode instances share it.
    #[arg(long, default_value = "cpu")]
    device: pdserve_gpu::device::Device,
    /// CUDA matmul weight type of every instance (`model.dtype`): auto, f16, bf16, f32.
    #[arg(long, default_value = "auto")]
    dtype: String,
    /// KV transport between instances: shm, tcp or quic (mutual TLS with the launcher's
    /// ephemeral cluster credentials).
    #[arg(long, default_value = "shm")]
    transport: String,
    /// KV transfer mode: `pull` (prefill holds the blocks, decode reads them; vLLM NIXL
    /// style) or `push` (decode sends its blocks, prefill writes each layer as it is
    /// computed; Mooncake/SGLang style).
    #[arg(long, default_value = "pull")]
    mode: String,
    /// Proxy address.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Proxy port (0 picks a free one).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Compute threads per instance (default: the cores divided among the instances).
    #[arg(long)]
    threads: Option<usize>,
    /// Pin every instance to its own CPUs: the CPUs this process may use are cut into one
    /// disjoint, contiguous set per instance (the remainder, if any, goes to the proxy, which
    /// otherwise shares them all), and each instance runs one compute thread per CPU of its
    /// set unless `--threads` says otherwise. Needs at least one CPU per instance. Instances
    /// added later by `pdserve scale` are not pinned.
    #[arg(long)]
    pin_cpus: bool,
    /// Run every actor in this process over the `local` transport.
    #[arg(long)]
    in_process: bool,
    /// One API key for the cluster: clients need `Authorization: Bearer KEY` at the proxy,
    /// and the instances require it on their `/v1/*` routes too (the proxy and decode
    /// instances send it). Handed to the children in their environment, not their command
    /// lines.
    #[arg(long)]
    api_key: Option<String>,
    /// How long a stopping (or scaled-down) instance may take to finish what it runs, in
    /// seconds (each instance's `server.drain_timeout_s`).
    #[arg(long, default_value_t = 30)]
    drain_timeout: u64,
    /// Times one request may move to another decode instance mid-generation (the proxy's
    /// `proxy.migration_limit`).
    #[arg(long, default_value_t = 1)]
    migration_limit: u32,
    /// Turn the prefix cache off in every instance (`scheduler.prefix_cache = false`).
    #[arg(long)]
    no_prefix_cache: bool,
    /// Turn the KV cache tiers on in every instance, each with its disk tier in
    /// `DIR/<instance name>` (`kv_tiers.enabled`, `kv_tiers.disk_dir`): an instance the
    /// launcher restarts finds its own directory warm, and no two instances share one. The
    /// host region and a shared store are set as usual (`PDSERVE_KV_TIERS__*`, which every
    /// instance inherits).
    #[arg(long, value_name = "DIR", conflicts_with = "in_process")]
    kv_disk_dir: Option<std::path::PathBuf>,
    /// How the proxy picks instances: `kv` (cached-prefix overlap and load), `least-loaded`
    /// or `round-robin` (the proxy's `proxy.router`).
    #[arg(long, default_value = "kv")]
    router: pdserve_runtime::config::RouterKind,
    #[command(flatten)]
    planner: crate::planner_driver::PlannerArgs,
}

/// `pdserve scale` flags.
#[derive(Args, Debug)]
pub struct ScaleArgs {
    /// `prefill`, `decode` or `encode`.
    role: String,
    /// The number of instances of that role wanted.
    count: usize,
    /// The credentials directory `pdserve launch` printed (its control socket lives there);
    /// also `$PDSERVE_CREDENTIALS_DIR`.
    #[arg(long, env = "PDSERVE_CREDENTIALS_DIR")]
    credentials_dir: PathBuf,
}

/// `pdserve scale ROLE N --credentials-dir DIR`: asks the launcher for N instances of ROLE.
///
/// # Errors
/// When the launcher cannot be reached or refuses.
pub fn scale(args: ScaleArgs) -> Result<()> {
    use std::io::{BufRead, BufReader, Write};
    let path = args.credentials_dir.join(CONTROL_SOCKET);
    let mut conn = std::os::unix::net::UnixStream::connect(&path)
        .with_context(|| format!("cannot reach the launcher at {}", path.display()))?;
    conn.set_read_timeout(Some(Duration::from_secs(30)))?;
    writeln!(conn, "scale {} {}", args.role, args.count)?;
    let mut answer = String::new();
    BufReader::new(conn).read_line(&mut answer)?;
    let answer = answer.trim();
    match answer.strip_prefix("ok ") {
        Some(rest) => {
            println!("{rest}");
            Ok(())
        }
        None => bail!("the launcher refused: {answer}"),
    }
}

fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// A free UDP port on 127.0.0.1 (the control plane is QUIC).
fn free_udp_port() -> Result<u16> {
    Ok(UdpSocket::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Name of the cluster `pdserve launch` creates.
const LAUNCH_CLUSTER: &str = "pdserve-launch";

/// Ephemeral cluster credentials for one launch: a CA and member certificates for every node
/// (and for `inspect`) in a private temporary directory, removed when this is dropped.
struct LaunchCredentials {
    dir: PathBuf,
}

impl LaunchCredentials {
    fn create(members: &[String]) -> Result<Self> {
        use std::os::unix::fs::DirBuilderExt;
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let dir =
            std::env::temp_dir().join(format!("pdserve-launch-{}-{nanos:09}", std::process::id()));
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&dir)
            .with_context(|| format!("creating {}", dir.display()))?;
        let creds = Self { dir };
        pdserve_transport::control::tls::init_cluster(&creds.dir, LAUNCH_CLUSTER)?;
        for m in members.iter().map(String::as_str).chain(["inspect"]) {
            pdserve_transport::control::tls::issue_member(&creds.dir, m)?;
        }
        Ok(creds)
    }

    fn dir(&self) -> &Path {
        &self.dir
    }

    /// Records the proxy's control address for `pdserve inspect` without ADDR, and prints
    /// the inspect command.
    fn announce(&self, control: SocketAddr) -> Result<()> {
        std::fs::write(
            self.dir.join(crate::inspect::PROXY_ADDR_FILE),
            format!("{control}\n"),
        )?;
        println!(
            "inspect: pdserve inspect {control} --credentials-dir {}",
            self.dir.display()
        );
        Ok(())
    }
}

impl Drop for LaunchCredentials {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_dir_all(&self.dir) {
            eprintln!("pdserve launch: cannot remove {}: {e}", self.dir.display());
        }
    }
}

struct Member {
    name: String,
    /// `prefill`, `decode` or `encode`; `None` for the proxy.
    role: Option<&'static str>,
    /// Asked to drain (SIGTERM sent): its exit is expected.
    draining: bool,
    args: Vec<String>,
    env: Vec<(&'static str, String)>,
    child: Option<Child>,
    tracker: RestartTracker,
    /// `--pin-cpus`: the CPUs this member runs on (`None`: whatever the launcher may use).
    cpus: Option<Vec<usize>>,
}

/// The CPUs of each instance, then the proxy's (`None`: it shares every CPU).
type CpuPlan = (Vec<Vec<usize>>, Option<Vec<usize>>);

/// `--pin-cpus`: `cpus` (the CPUs the launcher may use) cut into `instances` disjoint,
/// contiguous sets of equal size, and the CPUs left over for the proxy (`None` when there are
/// none: it then shares every CPU).
///
/// # Errors
/// Fewer CPUs than instances.
fn cpu_plan(cpus: &[usize], instances: usize) -> Result<CpuPlan> {
    if instances == 0 || cpus.len() < instances {
        bail!(
            "--pin-cpus needs at least one CPU per instance: {instances} instance(s), {} CPU(s) available to this process",
            cpus.len()
        );
    }
    let per = cpus.len() / instances;
    let sets = cpus
        .chunks(per)
        .take(instances)
        .map(<[usize]>::to_vec)
        .collect();
    let rest = &cpus[per * instances..];
    Ok((sets, (!rest.is_empty()).then(|| rest.to_vec())))
}

/// The CPUs this process may run on (its affinity mask), in increasing order.
fn allowed_cpus() -> Result<Vec<usize>> {
    // SAFETY: `set` is a plain bit set the kernel fills; its size is passed along.
    let set = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return Err(std::io::Error::last_os_error())
                .context("reading this process's CPU affinity");
        }
        set
    };
    // SAFETY: `set` is initialised; CPU_ISSET reads one bit below CPU_SETSIZE.
    Ok((0..libc::CPU_SETSIZE as usize)
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .collect())
}

fn spawn(m: &Member) -> Result<Child> {
    let exe = std::env::current_exe()?;
    let mut cmd = Command::new(exe);
    cmd.args(&m.args)
        .envs(m.env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .kill_on_drop(true);
    // The affinity set is built here: between fork and exec only system calls run.
    let pin = m.cpus.as_ref().map(|cpus| {
        // SAFETY: a zeroed cpu_set_t is the empty set; CPU_SET writes one bit of it.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            for &c in cpus {
                libc::CPU_SET(c, &mut set);
            }
            set
        }
    });
    // SAFETY: prctl and sched_setaffinity are async-signal-safe system calls; this runs in
    // the child between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if let Some(set) = &pin {
                if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), set) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    Ok(cmd.spawn()?)
}

async fn wait_ready(url: &str, members: &mut [Member]) -> Result<()> {
    let client = pdserve_actors::http::http_client()
        .timeout(Duration::from_secs(2))
        .build()?;
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        if let Ok(r) = client.get(format!("{url}/health")).send().await {
            if r.status().is_success() {
                return Ok(());
            }
        }
        for m in members.iter_mut() {
            if let Some(status) = m.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                bail!("{} exited during start-up ({status})", m.name);
            }
        }
        if Instant::now() > deadline {
            bail!("{url} did not become healthy within {READY_TIMEOUT:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Sends SIGTERM to a child (a drain, for an instance).
fn terminate(child: &Child) {
    if let Some(pid) = child.id() {
        // SAFETY: sending a signal to our own child process.
        unsafe {
            libc::kill(pid as i32, libc::SIGTERM);
        }
    }
}

/// Waits for `members`' children until `deadline`, then kills what is left.
async fn reap(members: &mut [Member], deadline: tokio::time::Instant) {
    for m in members.iter_mut() {
        if let Some(child) = m.child.as_mut() {
            if tokio::time::timeout_at(deadline, child.wait())
                .await
                .is_err()
            {
                eprintln!(
                    "pdserve launch: {} did not stop in time: killing it",
                    m.name
                );
                let _ = child.kill().await;
            }
        }
        m.child = None;
    }
}

/// Stops the cluster in order: the instances drain (SIGTERM; each finishes what it runs
/// within `drain`), then the proxy stops, so requests in flight reach their clients.
async fn stop_all(members: &mut [Member], drain: Duration) {
    let (mut instances, mut proxy): (Vec<&mut Member>, Vec<&mut Member>) =
        members.iter_mut().partition(|m| m.role.is_some());
    for m in instances.iter_mut() {
        if let Some(c) = &m.child {
            terminate(c);
        }
        m.draining = true;
    }
    let deadline = tokio::time::Instant::now() + drain + STOP_GRACE;
    for m in instances {
        reap(std::slice::from_mut(m), deadline).await;
    }
    for m in proxy.iter_mut() {
        if let Some(c) = &m.child {
            terminate(c);
        }
    }
    let deadline = tokio::time::Instant::now() + STOP_GRACE;
    for m in proxy {
        reap(std::slice::from_mut(m), deadline).await;
    }
}

/// How instances of the launched cluster are started.
struct InstanceTemplate {
    model: String,
    /// `--mmproj` of every instance.
    mmproj: Option<String>,
    /// `--served-model-name` of every instance (empty: the model's own name).
    served_model_name: Vec<String>,
    tp: usize,
    transport: String,
    threads: usize,
    dir: String,
    control: SocketAddr,
    mode: &'static str,
    drain_timeout: u64,
    api_key: Option<String>,
    /// `--no-prefix-cache` on every instance.
    no_prefix_cache: bool,
    /// `--device` and `--dtype` of every instance.
    device: String,
    dtype: String,
    /// `--kv-disk-dir`: each instance's disk tier is a subdirectory named after it.
    kv_disk_dir: Option<std::path::PathBuf>,
}

impl InstanceTemplate {
    fn member(&self, role: &'static str, i: usize) -> Member {
        let name = format!("{role}-{i}");
        let args: Vec<String> = [
            "serve",
            "--role",
            role,
            "--name",
            &name,
            "--model",
            &self.model,
            "--port",
            "0",
            "--tp",
            &self.tp.to_string(),
            "--transfer",
            &self.transport,
            "--threads",
            &self.threads.to_string(),
            "--credentials-dir",
            &self.dir,
            "--control-proxy",
            &self.control.to_string(),
            "--transfer-mode",
            self.mode,
            "--drain-timeout",
            &self.drain_timeout.to_string(),
            "--device",
            &self.device,
            "--dtype",
            &self.dtype,
        ]
        .iter()
        .map(|s| s.to_string())
        .chain(
            self.no_prefix_cache
                .then(|| "--no-prefix-cache".to_string()),
        )
        .chain(
            self.mmproj
                .iter()
                .flat_map(|m| ["--mmproj".to_string(), m.clone()]),
        )
        .chain((!self.served_model_name.is_empty()).then(|| "--served-model-name".to_string()))
        .chain(self.served_model_name.iter().cloned())
        .collect();
        let mut env: Vec<(&'static str, String)> = self
            .api_key
            .iter()
            .map(|k| ("PDSERVE_SERVER__API_KEY", k.clone()))
            .collect();
        if let Some(dir) = &self.kv_disk_dir {
            env.push(("PDSERVE_KV_TIERS__ENABLED", "true".into()));
            let own = dir.join(&name);
            env.push(("PDSERVE_KV_TIERS__DISK_DIR", own.display().to_string()));
        }
        Member {
            name,
            role: Some(role),
            draining: false,
            args,
            env,
            child: None,
            tracker: RestartTracker::new(RestartPolicy::default()),
            cpus: None,
        }
    }
}

/// Applies `scale ROLE N`: starts instances of `role` up to `n`, or drains the newest ones
/// down to `n`. Returns what it did, in words.
fn apply_scale(
    members: &mut Vec<Member>,
    template: &InstanceTemplate,
    creds: &LaunchCredentials,
    line: &str,
) -> Result<String> {
    let words: Vec<&str> = line.split_whitespace().collect();
    let (role, n) = match words[..] {
        ["scale", role, n] => (
            role,
            n.parse::<usize>().with_context(|| format!("count `{n}`"))?,
        ),
        _ => bail!("expected `scale prefill|decode|encode N`, got `{line}`"),
    };
    let role: &'static str = match role {
        "prefill" => "prefill",
        "decode" => "decode",
        "encode" => "encode",
        other => bail!("role `{other}`: expected prefill, decode or encode"),
    };
    if n == 0 && role != "encode" {
        bail!("a cluster needs at least one {role} instance");
    }
    // Instances asked to drain, or that already stopped after a drain of their own
    // (`pdserve drain`: exit 0), do not count.
    let active: Vec<usize> = members
        .iter_mut()
        .enumerate()
        .filter_map(|(i, m)| {
            if m.role != Some(role) || m.draining {
                return None;
            }
            let exited = m.child.as_mut().and_then(|c| c.try_wait().ok().flatten());
            (!exited.is_some_and(|s| s.success())).then_some(i)
        })
        .collect();
    if n > active.len() {
        let mut started = Vec::new();
        // Names are never reused within a launch: past the highest index that has
        // credentials (instances that were drained included).
        let first = std::fs::read_dir(creds.dir().join("members"))
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                let stem = name.strip_suffix(".crt")?;
                stem.strip_prefix(role)?
                    .strip_prefix('-')?
                    .parse::<usize>()
                    .ok()
            })
            .max()
            .map_or(0, |i| i + 1);
        for next in first..first + (n - active.len()) {
            let mut m = template.member(role, next);
            pdserve_transport::control::tls::issue_member(creds.dir(), &m.name)
                .with_context(|| format!("issuing credentials for {}", m.name))?;
            m.child = Some(spawn(&m).with_context(|| format!("starting {}", m.name))?);
            started.push(m.name.clone());
            members.push(m);
        }
        Ok(format!("started {}", started.join(" ")))
    } else {
        let mut drained = Vec::new();
        // The newest first.
        for &i in active.iter().rev().take(active.len() - n) {
            let m = &mut members[i];
            if let Some(c) = &m.child {
                terminate(c);
            }
            m.draining = true;
            drained.push(m.name.clone());
        }
        Ok(if drained.is_empty() {
            format!("{n} {role} instance(s) already")
        } else {
            format!("draining {}", drained.join(" "))
        })
    }
}

/// Serves one `pdserve scale` connection: reads its line, hands it to the launcher's loop,
/// writes the answer back.
async fn serve_scale(
    stream: tokio::net::UnixStream,
    requests: tokio::sync::mpsc::Sender<(String, tokio::sync::oneshot::Sender<String>)>,
) {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
    let (read, mut write) = stream.into_split();
    let mut line = String::new();
    let mut reader = BufReader::new(read);
    let read_line = reader.read_line(&mut line);
    if tokio::time::timeout(Duration::from_secs(10), read_line)
        .await
        .is_err()
    {
        return;
    }
    let (tx, rx) = tokio::sync::oneshot::channel();
    let answer = if requests.send((line.trim().to_string(), tx)).await.is_ok() {
        rx.await
            .unwrap_or_else(|_| "error the launcher is stopping".into())
    } else {
        "error the launcher is stopping".into()
    };
    let _ = write.write_all(format!("{answer}\n").as_bytes()).await;
}

/// Runs the launcher until Ctrl-C / SIGTERM or an unrecoverable child failure.
///
/// # Errors
/// Start-up failures, or a child that keeps crashing.
pub fn run(args: LaunchArgs) -> Result<()> {
    let mode: pdserve_actors::handoff::TransferMode = args.mode.parse()?;
    if args.prefill == 0 || args.decode == 0 {
        bail!("a cluster needs at least one prefill and one decode instance");
    }
    // A planner that cannot run is refused before anything starts.
    let planner = args.planner.planner()?;
    if planner.is_some() && args.in_process {
        bail!("--planner scales instance processes; it cannot be used with --in-process");
    }
    // A device that cannot run fails here, with its reason, before any child starts.
    crate::cuda::check(args.device, args.tp)?;
    // Fetch the model once, here, with its progress bar, before children race for it.
    if args.model == "default" {
        pdserve_gpu::fetch::pull_default_model(pdserve_gpu::fetch::Progress::Show)?;
    }
    let instances = args.prefill + args.decode + args.encode;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let pinning = if args.pin_cpus {
        if args.in_process {
            bail!("--pin-cpus pins instance processes; it cannot be used with --in-process");
        }
        Some(cpu_plan(&allowed_cpus()?, instances)?)
    } else {
        None
    };
    let threads = args.threads.unwrap_or(match &pinning {
        Some((sets, _)) => sets[0].len(),
        None => (cores / instances).max(1),
    });
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let names: Vec<String> = [
        ("prefill", args.prefill),
        ("decode", args.decode),
        ("encode", args.encode),
    ]
    .iter()
    .flat_map(|&(role, n)| (0..n).map(move |i| format!("{role}-{i}")))
    .chain(["proxy".to_string()])
    .collect();
    let creds = LaunchCredentials::create(&names).context("creating cluster credentials")?;
    if args.in_process {
        return rt.block_on(run_in_process(args, threads, &creds));
    }
    rt.block_on(async move {
        let proxy_port = if args.port == 0 { free_port()? } else { args.port };
        // Instances register with the proxy here; registration is what routes to them.
        let control = SocketAddr::from(([127, 0, 0, 1], free_udp_port()?));
        let drain = Duration::from_secs(args.drain_timeout);
        // Instances bind a port of the kernel's choosing (`--port 0`) and register their real
        // address with the proxy: no port picked here can be taken by someone else before the
        // child binds it.
        let template = InstanceTemplate {
            model: args.model.clone(),
            mmproj: args.mmproj.clone(),
            served_model_name: args.served_model_name.clone(),
            tp: args.tp,
            transport: args.transport.clone(),
            threads,
            dir: creds.dir().display().to_string(),
            control,
            mode: mode.as_str(),
            drain_timeout: args.drain_timeout,
            api_key: args.api_key.clone(),
            no_prefix_cache: args.no_prefix_cache,
            device: args.device.to_string(),
            dtype: args.dtype.clone(),
            kv_disk_dir: args.kv_disk_dir.clone(),
        };
        let mut members = Vec::new();
        for (role, count) in [
            ("prefill", args.prefill),
            ("decode", args.decode),
            ("encode", args.encode),
        ] {
            for i in 0..count {
                members.push(template.member(role, i));
            }
        }
        let (instance_cpus, proxy_cpus) = match pinning {
            Some((sets, rest)) => (sets.into_iter().map(Some).collect(), rest),
            None => (vec![None; members.len()], None),
        };
        for (m, cpus) in members.iter_mut().zip(instance_cpus) {
            m.cpus = cpus;
        }
        let proxy_args: Vec<String> = [
            "proxy", "--host", &args.host, "--port", &proxy_port.to_string(),
            "--credentials-dir", &template.dir, "--node", "proxy", "--control-listen", &control.to_string(),
            "--migration-limit", &args.migration_limit.to_string(),
            "--router", args.router.as_str(), "--model", &args.model,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let env = args.api_key.iter().map(|k| ("PDSERVE_PROXY_API_KEY", k.clone())).collect();
        members.push(Member { name: "proxy".into(), role: None, draining: false, args: proxy_args, env, child: None, tracker: RestartTracker::new(RestartPolicy::default()), cpus: proxy_cpus });
        for m in &mut members {
            m.child = Some(spawn(m).with_context(|| format!("starting {}", m.name))?);
        }
        let proxy_url = format!("http://{}:{proxy_port}", args.host);
        if let Err(e) = wait_ready(&proxy_url, &mut members).await {
            stop_all(&mut members, drain).await;
            return Err(e);
        }
        // `pdserve scale` talks to this loop through the control socket.
        let socket = creds.dir().join(CONTROL_SOCKET);
        let listener = tokio::net::UnixListener::bind(&socket)
            .with_context(|| format!("binding {}", socket.display()))?;
        let (scale_tx, mut scale_rx) = tokio::sync::mpsc::channel(8);
        let accept = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                tokio::spawn(serve_scale(stream, scale_tx.clone()));
            }
        });
        let mut stop = crate::signals::StopSignals::new()?;
        println!("{proxy_url}");
        creds.announce(control)?;
        eprintln!(
            "pdserve launch: {} prefill + {} decode + {} encode instance(s) of `{}` over {}, proxy at {proxy_url} (Ctrl-C drains and stops; `pdserve scale ROLE N --credentials-dir {}` adds or drains instances)",
            args.prefill, args.decode, args.encode, args.model, args.transport, template.dir
        );
        let mut check = tokio::time::interval(Duration::from_millis(500));
        let mut driver = match planner {
            Some(p) => Some(crate::planner_driver::Driver::new(p, (creds.dir(), "inspect"), proxy_url.clone(), control, args.api_key.as_deref())?),
            None => None,
        };
        let window = driver.as_ref().map_or(Duration::from_secs(3600), |d| d.window());
        let mut plan_tick = tokio::time::interval_at(tokio::time::Instant::now() + window, window);
        plan_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let outcome = loop {
            tokio::select! {
                _ = stop.recv() => break Ok(()),
                Some((line, reply)) = scale_rx.recv() => {
                    let answer = match apply_scale(&mut members, &template, &creds, &line) {
                        Ok(done) => {
                            eprintln!("pdserve launch: {line}: {done}");
                            format!("ok {done}")
                        }
                        Err(e) => format!("error {e:#}"),
                    };
                    let _ = reply.send(answer);
                }
                _ = plan_tick.tick(), if driver.is_some() => {
                    let Some(d) = driver.as_mut() else { continue };
                    let count = |role: &str| members.iter().filter(|m| m.role == Some(role) && !m.draining).count();
                    let current = pdserve_core::planner::Split::new(count("prefill"), count("decode"));
                    match d.observe(Some(current)).await {
                        Ok((_, decision)) => {
                            eprintln!("pdserve launch: planner window: {current} -> {} ({})", decision.split, decision.reason);
                            for (role, want, now) in [("prefill", decision.split.prefill, current.prefill), ("decode", decision.split.decode, current.decode)] {
                                if want == now {
                                    continue;
                                }
                                let line = format!("scale {role} {want}");
                                match apply_scale(&mut members, &template, &creds, &line) {
                                    Ok(done) => eprintln!("pdserve launch: planner {current} -> {}: {done} ({})", decision.split, decision.reason),
                                    Err(e) => eprintln!("pdserve launch: planner: {line}: {e:#}"),
                                }
                            }
                        }
                        Err(e) => eprintln!("pdserve launch: planner window skipped: {e:#}"),
                    }
                }
                _ = check.tick() => {
                    let mut failed = None;
                    let mut gone = Vec::new();
                    for (idx, m) in members.iter_mut().enumerate() {
                        let exited = m.child.as_mut().and_then(|c| c.try_wait().ok().flatten());
                        let Some(status) = exited else { continue };
                        // An instance that drained (asked to, or `pdserve drain`) exits 0: it
                        // is gone for good, not restarted.
                        if m.role.is_some() && (m.draining || status.success()) {
                            eprintln!("pdserve launch: {} drained and stopped ({status})", m.name);
                            gone.push(idx);
                            continue;
                        }
                        match m.tracker.on_failure(Instant::now()) {
                            RestartDecision::Restart { attempt } => {
                                eprintln!("pdserve launch: {} exited ({status}); restart {attempt}", m.name);
                                match spawn(m) {
                                    Ok(c) => m.child = Some(c),
                                    Err(e) => { failed = Some(format!("cannot restart {}: {e}", m.name)); break; }
                                }
                            }
                            RestartDecision::Escalate { restarts_in_window } => {
                                failed = Some(format!("{} keeps crashing ({restarts_in_window} restarts within the window, last: {status})", m.name));
                                break;
                            }
                        }
                    }
                    for idx in gone.into_iter().rev() {
                        members.remove(idx);
                    }
                    if let Some(f) = failed { break Err(anyhow::anyhow!(f)); }
                }
            }
        };
        accept.abort();
        stop_all(&mut members, drain).await;
        outcome
    })
}

async fn run_in_process(args: LaunchArgs, threads: usize, creds: &LaunchCredentials) -> Result<()> {
    use pdserve_actors::control_plane::InstanceControl;
    use pdserve_actors::{Instance, InstanceOptions};
    use pdserve_gpu::loader::{load_model, ModelSource};
    use pdserve_runtime::Role;
    use pdserve_transport::control::tls::MemberCredentials;
    crate::set_threads(Some(threads));
    let source: ModelSource = args.model.parse().expect("infallible");
    // The proxy first: instances register with its control plane as they come up.
    let bind: SocketAddr = format!("{}:{}", args.host, args.port).parse()?;
    // The config's proxy defaults (admission and connection bounds included), with the
    // launcher's choices.
    let mut pargs = pdserve_actors::proxy::ProxyArgs::new(bind, Vec::new(), Vec::new());
    pargs.api_key = args.api_key.clone();
    pargs.migration_limit = args.migration_limit;
    pargs.router = args.router;
    pargs.kv_index_max_blocks = pdserve_actors::kv_events::DEFAULT_INDEX_MAX_BLOCKS;
    pargs.tokenizer = {
        let (tokenizer, template) =
            tokio::task::block_in_place(|| pdserve_gpu::loader::load_tokenizer(&source))?;
        Some(std::sync::Arc::new(
            pdserve_actors::proxy::PromptTokenizer {
                tokenizer,
                template,
            },
        ))
    };
    let control = pdserve_actors::proxy::ProxyControlArgs::new(
        MemberCredentials::load(creds.dir(), "proxy")?,
        SocketAddr::from(([127, 0, 0, 1], 0)),
    );
    let proxy =
        pdserve_actors::proxy::start_proxy_with_control("proxy", pargs, Some(control)).await?;
    let addr = proxy.addr;
    let control_addr = proxy
        .control_addr()
        .await?
        .context("the proxy started without its control plane")?;
    let mut instances = Vec::new();
    for (role, count) in [
        (Role::Prefill, args.prefill),
        (Role::Decode, args.decode),
        (Role::Encode, args.encode),
    ] {
        for i in 0..count {
            let mut model = tokio::task::block_in_place(|| load_model(&source))?;
            if let Some(path) = &args.mmproj {
                pdserve_gpu::loader::attach_mmproj(&mut model, std::path::Path::new(path))?;
            }
            let name = format!("{role}-{i}");
            let mut o = InstanceOptions::local(&name, model);
            o.tp = args.tp;
            o.served_name = args.served_model_name.clone();
            o.prefix_cache = !args.no_prefix_cache;
            o.api_key = args.api_key.clone();
            o.drain_timeout = Duration::from_secs(args.drain_timeout);
            o.num_blocks = None;
            o.kv_cache_bytes = 256 << 20;
            o.device =
                pdserve_actors::worker::RankDevice::for_device(args.device, &args.dtype, role)?;
            o.transfer = Some(pdserve_transport::TransferConfig::new(
                pdserve_transport::BackendKind::Local,
                name.clone(),
            ));
            o.encode = role == Role::Encode;
            let mut ctl = InstanceControl::new(MemberCredentials::load(creds.dir(), &name)?, role);
            ctl.proxy = Some(control_addr);
            o.control = Some(ctl);
            let inst = Instance::start(o).await?;
            instances.push(inst);
        }
    }
    let url = format!("http://{addr}");
    if let Err(e) = wait_ready(&url, &mut []).await {
        proxy.stop().await;
        for i in instances {
            i.stop().await;
        }
        return Err(e);
    }
    let mut stop = crate::signals::StopSignals::new()?;
    println!("{url}");
    creds.announce(control_addr)?;
    eprintln!(
        "pdserve launch --in-process: {} instance(s), proxy at http://{addr} (Ctrl-C stops)",
        instances.len()
    );
    stop.recv().await;
    // Instances first (each drains and leaves the proxy's routing set), the proxy last.
    for i in instances {
        i.stop().await;
    }
    proxy.stop().await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::cpu_plan;

    #[test]
    fn pinned_instances_get_disjoint_equal_sets_and_the_proxy_the_rest() {
        let (sets, proxy) = cpu_plan(&[0, 1], 2).unwrap();
        assert_eq!(sets, [vec![0], vec![1]]);
        assert_eq!(proxy, None);
        // Not necessarily CPUs 0..n: whatever the affinity mask allows, in order.
        let (sets, proxy) = cpu_plan(&[2, 3, 5, 6, 7, 9, 11], 3).unwrap();
        assert_eq!(sets, [vec![2, 3], vec![5, 6], vec![7, 9]]);
        assert_eq!(proxy, Some(vec![11]));
    }

    #[test]
    fn pinning_more_instances_than_cpus_is_refused_by_name() {
        let err = cpu_plan(&[0, 1], 3).unwrap_err().to_string();
        assert!(
            err.contains("--pin-cpus needs at least one CPU per instance"),
            "{err}"
        );
        assert!(err.contains("3 instance(s), 2 CPU(s)"), "{err}");
    }
}
