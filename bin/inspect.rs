//! `pdserve inspect [ADDR]`: the live supervision tree of a cluster (through its proxy) or of
//! one instance, fetched over the mutual-TLS control plane.
//!
//! The tool is a cluster member like any other: it needs the cluster's credentials directory
//! and a member certificate (`--node`, default `inspect`). When `DIR/members/NODE.crt` does
//! not exist but the CA key does (`DIR/ca.key`, as in the directory `pdserve launch` makes),
//! a certificate is issued in memory for this run.

use anyhow::{bail, Context, Result};
use clap::Args;
use pdserve_runtime::supervision::{
    render_cluster, render_tree, ClusterSnapshot, InstanceSnapshot,
};
use pdserve_runtime::wire::{ControlMessage, InspectAnswer, Role};
use pdserve_transport::control::tls::{ClusterCredentials, MemberCredentials};
use pdserve_transport::control::{ControlConfig, ControlConnection, ControlEndpoint};
use pdserve_transport::TransportError;
use std::io::{IsTerminal, Write};
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The file in a credentials directory where `pdserve launch` writes its proxy's control
/// address; `pdserve inspect` reads it when no ADDR is given.
pub const PROXY_ADDR_FILE: &str = "proxy-control-addr";

/// `pdserve inspect` flags.
#[derive(Args, Debug, Clone)]
pub struct InspectArgs {
    /// Control address (`host:port`) of a proxy (the whole cluster) or of one instance.
    /// Default: the address `pdserve launch` wrote to DIR/proxy-control-addr.
    addr: Option<String>,
    /// Cluster credentials directory (`pdserve cluster init`, or the one `pdserve launch`
    /// prints).
    #[arg(long, env = "PDSERVE_CREDENTIALS_DIR")]
    credentials_dir: PathBuf,
    /// Member certificate to present (DIR/members/NODE.crt); issued in memory when missing
    /// and DIR holds the CA key.
    #[arg(long, default_value = "inspect")]
    node: String,
    /// Print the snapshot as JSON instead of a tree.
    #[arg(long)]
    json: bool,
    /// Redraw every SECS seconds (default 2) until Ctrl-C.
    #[arg(long, num_args = 0..=1, default_missing_value = "2", value_name = "SECS")]
    watch: Option<f64>,
    /// Seconds to wait for the connection and for the answer.
    #[arg(long, default_value_t = 10.0)]
    timeout: f64,
}

/// What came back: a cluster (from a proxy) or one instance.
enum Snapshot {
    Cluster(ClusterSnapshot),
    Instance(InstanceSnapshot),
}

impl Snapshot {
    fn json(&self) -> Result<String> {
        Ok(match self {
            Snapshot::Cluster(c) => serde_json::to_string_pretty(c)?,
            Snapshot::Instance(i) => serde_json::to_string_pretty(i)?,
        })
    }

    fn tree(&self, color: bool) -> String {
        match self {
            Snapshot::Cluster(c) => render_cluster(c, color),
            Snapshot::Instance(i) => render_tree(i, color),
        }
    }
}

/// The member credentials to present: DIR/members/NODE, or issued in memory from DIR's CA.
fn credentials(dir: &Path, node: &str) -> Result<MemberCredentials> {
    if !dir.join("cluster-name").exists() || !dir.join("ca.crt").exists() {
        bail!(
            "{} is not a cluster credentials directory (no cluster-name / ca.crt); create one with `pdserve cluster init`",
            dir.display()
        );
    }
    let member = dir.join("members").join(format!("{node}.crt"));
    if member.exists() {
        return MemberCredentials::load(dir, node).with_context(|| {
            format!("loading member credentials `{node}` from {}", dir.display())
        });
    }
    if dir.join("ca.key").exists() {
        let ca = ClusterCredentials::load(dir)
            .with_context(|| format!("loading the cluster CA from {}", dir.display()))?;
        return ca
            .issue(node)
            .with_context(|| format!("issuing member credentials for `{node}`"));
    }
    bail!(
        "no member credentials for `{node}` in {}/members and no CA key there to issue them: run `pdserve cluster issue DIR {node}` where the CA is, or pass --node with an existing member",
        dir.display()
    )
}

fn resolve(addr: &str) -> Result<SocketAddr> {
    addr.to_socket_addrs()
        .with_context(|| format!("`{addr}` is not a host:port address"))?
        .next()
        .with_context(|| format!("`{addr}` resolves to no address"))
}

fn target(args: &InspectArgs) -> Result<SocketAddr> {
    match &args.addr {
        Some(a) => resolve(a),
        None => {
            let file = args.credentials_dir.join(PROXY_ADDR_FILE);
            let text = std::fs::read_to_string(&file).with_context(|| {
                format!(
                    "no ADDR given and {} cannot be read: pass the control address of a proxy or instance",
                    file.display()
                )
            })?;
            resolve(text.trim())
        }
    }
}

/// Turns a connect failure into the message a user needs.
fn connect_error(addr: SocketAddr, cluster: &str, e: TransportError) -> anyhow::Error {
    match e {
        TransportError::Unauthenticated(why) => anyhow::anyhow!(
            "{addr} refused our credentials, or is not a member of cluster `{cluster}`: {why}"
        ),
        TransportError::Timeout { after, .. } => anyhow::anyhow!(
            "cannot reach {addr}: no control-plane answer within {after:?} (is it a pdserve control address, and is UDP open?)"
        ),
        TransportError::PeerGone { reason, .. } => anyhow::anyhow!(
            "{addr} closed the connection during the handshake ({reason}): are these credentials from its cluster?"
        ),
        other => anyhow::anyhow!("cannot connect to {addr}: {other}"),
    }
}

async fn fetch(conn: &ControlConnection) -> Result<Snapshot> {
    let answer = conn
        .request(ControlMessage::InspectRequest)
        .await
        .with_context(|| format!("inspect request to {}", conn.remote_address()))?;
    match answer {
        ControlMessage::Inspect(answer) => Ok(match *answer {
            InspectAnswer::Cluster(c) => Snapshot::Cluster(c),
            InspectAnswer::Instance(i) => Snapshot::Instance(i),
        }),
        other => bail!(
            "{} answered inspect with {}",
            conn.remote_address(),
            other.name()
        ),
    }
}

/// Runs `pdserve inspect`.
///
/// # Errors
/// Unusable credentials, an unreachable address, refused credentials, a bad answer.
pub fn run(args: InspectArgs) -> Result<()> {
    if !(args.timeout.is_finite() && args.timeout > 0.0) {
        bail!("--timeout must be a positive number of seconds");
    }
    if let Some(w) = args.watch {
        if !(w.is_finite() && w >= 0.1) {
            bail!("--watch must be at least 0.1 seconds");
        }
    }
    let creds = credentials(&args.credentials_dir, &args.node)?;
    let addr = target(&args)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(inspect(args, creds, addr))
}

async fn inspect(args: InspectArgs, creds: MemberCredentials, addr: SocketAddr) -> Result<()> {
    let timeout = Duration::from_secs_f64(args.timeout);
    let listen: SocketAddr = if addr.is_ipv4() {
        "0.0.0.0:0".parse()?
    } else {
        "[::]:0".parse()?
    };
    let config = ControlConfig {
        listen,
        role: Role::Other,
        request_timeout: timeout,
        idle_timeout: timeout.max(Duration::from_secs(3)),
        ..ControlConfig::default()
    };
    let endpoint = ControlEndpoint::bind(&creds, config).context("binding a control endpoint")?;
    let cluster = creds.cluster().to_string();
    let mut conn = endpoint
        .connect(addr)
        .await
        .map_err(|e| connect_error(addr, &cluster, e))?;
    let color =
        std::io::stdout().is_terminal() && std::env::var_os("NO_COLOR").is_none() && !args.json;
    let Some(every) = args.watch else {
        let snap = fetch(&conn).await?;
        let out = if args.json {
            snap.json()?
        } else {
            snap.tree(color)
        };
        println!("{}", out.trim_end());
        return Ok(());
    };
    // --watch: the first fetch must work; later failures are shown and retried.
    let every = Duration::from_secs_f64(every);
    let mut snap = Some(fetch(&conn).await?);
    let mut problem: Option<String> = None;
    let mut stdout = std::io::stdout();
    loop {
        let body = match &snap {
            Some(s) if args.json => s.json()?,
            Some(s) => s.tree(color),
            None => String::new(),
        };
        let status = match &problem {
            Some(p) => format!("last refresh failed: {p}"),
            None => "Ctrl-C stops".to_string(),
        };
        write!(
            stdout,
            "\x1b[2J\x1b[H{addr} every {every:?} ({status})\n\n{}\n",
            body.trim_end()
        )?;
        stdout.flush()?;
        tokio::select! {
            _ = tokio::signal::ctrl_c() => return Ok(()),
            () = tokio::time::sleep(every) => {}
        }
        if !conn.is_alive() {
            match endpoint.connect(addr).await {
                Ok(c) => conn = c,
                Err(e) => {
                    problem = Some(connect_error(addr, &cluster, e).to_string());
                    continue;
                }
            }
        }
        match fetch(&conn).await {
            Ok(s) => {
                snap = Some(s);
                problem = None;
            }
            Err(e) => problem = Some(format!("{e:#}")),
        }
    }
}
