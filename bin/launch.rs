//! `pdserve launch`: a single-node P/D cluster — a proxy, N prefill and M decode instances,
//! each a child process this launcher supervises (restart on crash under a budget, then stop
//! everything), with the proxy URL printed on a line of its own. Ctrl-C or SIGTERM stops every
//! child (SIGTERM, then SIGKILL after a grace period); children also get SIGTERM if the
//! launcher itself dies (`PR_SET_PDEATHSIG`), so none is left behind.
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
/// Grace period between SIGTERM and SIGKILL at shutdown.
const STOP_GRACE: Duration = Duration::from_secs(10);

/// `pdserve launch` flags.
#[derive(Args, Debug, Clone)]
pub struct LaunchArgs {
    /// `default`, a GGUF file, an HF directory, or `synthetic:NAME`.
    #[arg(long, default_value = "default")]
    model: String,
    /// Prefill instances.
    #[arg(long, default_value_t = 1)]
    prefill: usize,
    /// Decode instances.
    #[arg(long, default_value_t = 1)]
    decode: usize,
    /// Tensor-parallel ranks per instance.
    #[arg(long, default_value_t = 1)]
    tp: usize,
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
    /// Run every actor in this process over the `local` transport.
    #[arg(long)]
    in_process: bool,
    /// One API key for the cluster: clients need `Authorization: Bearer KEY` at the proxy,
    /// and the instances require it on their `/v1/*` routes too (the proxy and decode
    /// instances send it). Handed to the children in their environment, not their command
    /// lines.
    #[arg(long)]
    api_key: Option<String>,
    /// Turn the prefix cache off in every instance (`scheduler.prefix_cache = false`).
    #[arg(long)]
    no_prefix_cache: bool,
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
    args: Vec<String>,
    env: Vec<(&'static str, String)>,
    child: Option<Child>,
    tracker: RestartTracker,
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
    // SAFETY: prctl is async-signal-safe; this runs in the child between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    Ok(cmd.spawn()?)
}

async fn wait_ready(url: &str, members: &mut [Member]) -> Result<()> {
    let client = reqwest::Client::builder()
        .no_proxy()
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

async fn stop_all(members: &mut [Member]) {
    for m in members.iter() {
        if let Some(pid) = m.child.as_ref().and_then(Child::id) {
            // SAFETY: sending a signal to our own child process.
            unsafe {
                libc::kill(pid as i32, libc::SIGTERM);
            }
        }
    }
    let deadline = tokio::time::Instant::now() + STOP_GRACE;
    for m in members.iter_mut() {
        if let Some(child) = m.child.as_mut() {
            if tokio::time::timeout_at(deadline, child.wait())
                .await
                .is_err()
            {
                let _ = child.kill().await;
            }
        }
        m.child = None;
    }
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
    // Fetch the model once, here, with its progress bar, before children race for it.
    if args.model == "default" {
        pdserve_gpu::fetch::pull_default_model(pdserve_gpu::fetch::Progress::Show)?;
    }
    let instances = args.prefill + args.decode;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = args.threads.unwrap_or((cores / instances).max(1));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let names: Vec<String> = [("prefill", args.prefill), ("decode", args.decode)]
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
        let dir = creds.dir().display().to_string();
        let mut members = Vec::new();
        // Instances bind a port of the kernel's choosing (`--port 0`) and register their real
        // address with the proxy: no port picked here can be taken by someone else before the
        // child binds it.
        for (role, count) in [("prefill", args.prefill), ("decode", args.decode)] {
            for i in 0..count {
                let name = format!("{role}-{i}");
                let a: Vec<String> = [
                    "serve", "--role", role, "--name", &name, "--model", &args.model, "--port", "0",
                    "--tp", &args.tp.to_string(), "--transfer", &args.transport, "--threads", &threads.to_string(),
                    "--credentials-dir", &dir, "--control-proxy", &control.to_string(),
                    "--transfer-mode", mode.as_str(),
                ]
                .iter()
                .map(|s| s.to_string())
                .chain(args.no_prefix_cache.then(|| "--no-prefix-cache".to_string()))
                .collect();
                let env = args.api_key.iter().map(|k| ("PDSERVE_SERVER__API_KEY", k.clone())).collect();
                members.push(Member { name, args: a, env, child: None, tracker: RestartTracker::new(RestartPolicy::default()) });
            }
        }
        let proxy_args: Vec<String> = [
            "proxy", "--host", &args.host, "--port", &proxy_port.to_string(),
            "--credentials-dir", &dir, "--node", "proxy", "--control-listen", &control.to_string(),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let env = args.api_key.iter().map(|k| ("PDSERVE_PROXY_API_KEY", k.clone())).collect();
        members.push(Member { name: "proxy".into(), args: proxy_args, env, child: None, tracker: RestartTracker::new(RestartPolicy::default()) });
        for m in &mut members {
            m.child = Some(spawn(m).with_context(|| format!("starting {}", m.name))?);
        }
        let proxy_url = format!("http://{}:{proxy_port}", args.host);
        if let Err(e) = wait_ready(&proxy_url, &mut members).await {
            stop_all(&mut members).await;
            return Err(e);
        }
        println!("{proxy_url}");
        creds.announce(control)?;
        eprintln!(
            "pdserve launch: {} prefill + {} decode instance(s) of `{}` over {}, proxy at {proxy_url} (Ctrl-C stops)",
            args.prefill, args.decode, args.model, args.transport
        );
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        let mut check = tokio::time::interval(Duration::from_millis(500));
        let outcome = loop {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => break Ok(()),
                _ = term.recv() => break Ok(()),
                _ = check.tick() => {
                    let mut failed = None;
                    for m in members.iter_mut() {
                        let exited = m.child.as_mut().and_then(|c| c.try_wait().ok().flatten());
                        let Some(status) = exited else { continue };
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
                    if let Some(f) = failed { break Err(anyhow::anyhow!(f)); }
                }
            }
        };
        stop_all(&mut members).await;
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
    let pargs = pdserve_actors::proxy::ProxyArgs {
        bind,
        prefill: Vec::new(),
        decode: Vec::new(),
        timeout: Duration::from_secs(600),
        max_prefill_queue: None,
        api_key: args.api_key.clone(),
        call_timeout: Duration::from_secs(5),
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
    for (role, count) in [(Role::Prefill, args.prefill), (Role::Decode, args.decode)] {
        for i in 0..count {
            let model = tokio::task::block_in_place(|| load_model(&source))?;
            let name = format!("{role}-{i}");
            let mut o = InstanceOptions::local(&name, model);
            o.tp = args.tp;
            o.prefix_cache = !args.no_prefix_cache;
            o.api_key = args.api_key.clone();
            o.num_blocks = None;
            o.kv_cache_bytes = 256 << 20;
            o.transfer = Some(pdserve_transport::TransferConfig::new(
                pdserve_transport::BackendKind::Local,
                name.clone(),
            ));
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
    println!("{url}");
    creds.announce(control_addr)?;
    eprintln!(
        "pdserve launch --in-process: {} instance(s), proxy at http://{addr} (Ctrl-C stops)",
        instances.len()
    );
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    // Instances first (each drains and leaves the proxy's routing set), the proxy last.
    for i in instances {
        i.stop().await;
    }
    proxy.stop().await;
    Ok(())
}
