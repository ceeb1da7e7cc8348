//! Helpers shared by the end-to-end tests that run `pdserve` processes.
#![allow(dead_code)] // each test binary uses its own subset

use std::process::Command;

/// Processes whose environment carries `tag` (`KEY=VALUE`; children inherit the launcher's
/// environment, so this finds a launcher and everything it started).
pub fn tagged_processes(tag: &str) -> Vec<u32> {
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        if let Ok(env) = std::fs::read(entry.path().join("environ")) {
            if env.split(|&b| b == 0).any(|kv| kv == tag.as_bytes()) {
                pids.push(pid);
            }
        }
    }
    pids
}

/// Runs `pdserve inspect ARGS...` (bounded by its own `--timeout`); returns (success, stdout,
/// stderr).
pub fn inspect(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_pdserve"))
        .arg("inspect")
        .args(args)
        .args(["--timeout", "5"])
        .env("NO_COLOR", "1")
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Ports the tests of this process reserved: each lock is held until the process exits.
static RESERVED: std::sync::Mutex<Vec<(u16, std::fs::File)>> = std::sync::Mutex::new(Vec::new());
/// Next candidate port (an offset into [`test_port_range`]); starts at a per-process offset.
static NEXT_PORT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(u32::MAX);

/// Where test ports come from: below the kernel's ephemeral range
/// (`/proc/sys/net/ipv4/ip_local_port_range`), so that no `bind(0)` and no outgoing connection
/// of any process — a node's own transfer or control listener included — can be handed one of
/// them; above it when there is no room below. Only when the ephemeral range covers nearly
/// everything does it fall back to all unprivileged ports (then a node can still find its port
/// taken, and says so in its log).
pub fn test_port_range() -> (u16, u16) {
    let (lo, hi) = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| {
            let mut it = s.split_whitespace().map(|v| v.parse::<u16>().ok());
            Some((it.next()??, it.next()??))
        })
        .unwrap_or((32768, 60999));
    if lo >= 12_000 {
        (10_000, lo - 1)
    } else if hi <= 63_000 {
        (hi + 1, 65_535)
    } else {
        (1024, 65_535)
    }
}

/// A port on 127.0.0.1 that is free for TCP and UDP alike (an HTTP port and a QUIC control
/// port may share a number), that no other test process on this machine is given while this
/// one lives (an exclusive `flock` on `$TMPDIR/pdserve-test-ports/PORT`, held until exit), and
/// that the kernel never hands out on its own (see [`test_port_range`]).
///
/// A port found with `bind(127.0.0.1:0)` and released would be none of these: between the
/// release and the node's bind, another node's listener on port 0, or another test process, can
/// take it; the node then exits and the cluster never becomes healthy (issue 34).
///
/// # Panics
/// When no port of the range can be reserved.
pub fn free_port() -> u16 {
    use std::os::fd::AsRawFd;
    use std::sync::atomic::Ordering;
    let (lo, hi) = test_port_range();
    let size = u32::from(hi - lo) + 1;
    if NEXT_PORT.load(Ordering::SeqCst) == u32::MAX {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .subsec_nanos();
        let seed = std::process::id().wrapping_mul(2_654_435_761) ^ nanos;
        let _ =
            NEXT_PORT.compare_exchange(u32::MAX, seed % size, Ordering::SeqCst, Ordering::SeqCst);
    }
    let dir = std::env::temp_dir().join("pdserve-test-ports");
    if std::fs::create_dir_all(&dir).is_ok() {
        use std::os::unix::fs::PermissionsExt;
        // Shared by every user's test runs: sticky and world-writable, like /tmp itself.
        let _ = std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o1777));
    }
    let mut reserved = RESERVED.lock().unwrap_or_else(|e| e.into_inner());
    for _ in 0..size {
        let port = lo + (NEXT_PORT.fetch_add(1, Ordering::SeqCst) % size) as u16;
        if reserved.iter().any(|(p, _)| *p == port) {
            continue;
        }
        let Ok(lock) = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(dir.join(port.to_string()))
        else {
            continue;
        };
        // SAFETY: flock on a file descriptor we own.
        if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            continue; // another test process holds it
        }
        // Not in use by anything else right now (a service, a test of an older checkout).
        let free = std::net::TcpListener::bind(("127.0.0.1", port)).is_ok()
            && std::net::UdpSocket::bind(("127.0.0.1", port)).is_ok();
        if free {
            reserved.push((port, lock));
            return port;
        }
    }
    panic!("no free port left in {lo}..={hi}");
}

/// A port for a node's HTTP API: see [`free_port`].
pub fn free_tcp_port() -> u16 {
    free_port()
}

/// A port for a control plane (QUIC, UDP): see [`free_port`].
pub fn free_udp_port() -> u16 {
    free_port()
}

/// The last `n` lines of the file at `path` (or why it cannot be read).
pub fn log_tail(path: &std::path::Path, n: usize) -> String {
    match std::fs::read(path) {
        Ok(bytes) => {
            let text = String::from_utf8_lossy(&bytes);
            let lines: Vec<&str> = text.lines().collect();
            lines[lines.len().saturating_sub(n)..].join("\n")
        }
        Err(e) => format!("(cannot read {}: {e})", path.display()),
    }
}

/// Lines of a node's log printed when a test fails.
pub const LOG_TAIL_LINES: usize = 60;

/// Stops node processes `(name, child, log file)`: SIGTERM to all still running, then up to
/// 10 s each to exit before SIGKILL. When the test is panicking, prints the end of each node's
/// log.
pub fn stop_nodes<N: std::fmt::Display>(
    nodes: &mut [(N, std::process::Child, std::path::PathBuf)],
) {
    for (_, child, _) in nodes.iter_mut() {
        // Only a child not reaped yet: a reaped one's pid may belong to another process now.
        if matches!(child.try_wait(), Ok(None)) {
            // SAFETY: signalling our own child, which has not been reaped.
            unsafe {
                libc::kill(child.id() as i32, libc::SIGTERM);
            }
        }
    }
    for (node, child, log) in nodes.iter_mut() {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while child.try_wait().ok().flatten().is_none() && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let _ = child.kill();
        let status = child.wait();
        if std::thread::panicking() {
            eprintln!(
                "--- {node} ({}; {}; last {LOG_TAIL_LINES} lines) ---\n{}",
                match status {
                    Ok(s) => s.to_string(),
                    Err(e) => e.to_string(),
                },
                log.display(),
                log_tail(log, LOG_TAIL_LINES)
            );
        }
    }
}

/// `pdserve` (or other) child processes of one test. Each writes its stdout and stderr to a
/// log file of its own, `NAME.log` in a temporary directory (a node started again under the
/// same name appends to the same file, after a header line). On drop every child still
/// running gets SIGTERM, then SIGKILL; when the test is failing, the tail of every log is
/// printed and the directory is kept (its path printed) for a closer look.
pub struct Procs {
    dir: Option<tempfile::TempDir>,
    /// `(name, child, log file)` of every process started, in start order.
    pub nodes: Vec<(String, std::process::Child, std::path::PathBuf)>,
    /// Indices into `nodes` of the processes the test stopped itself.
    stopped: Vec<usize>,
}

impl Default for Procs {
    fn default() -> Self {
        Self::new()
    }
}

impl Procs {
    /// No processes yet; logs go to a new temporary directory.
    pub fn new() -> Self {
        Procs {
            dir: Some(
                tempfile::Builder::new()
                    .prefix("pdserve-test-logs-")
                    .tempdir()
                    .unwrap(),
            ),
            nodes: Vec::new(),
            stopped: Vec::new(),
        }
    }

    /// The directory of the logs.
    pub fn dir(&self) -> &std::path::Path {
        self.dir.as_ref().expect("kept only on drop").path()
    }

    /// The log file of `name`.
    pub fn log_path(&self, name: &str) -> std::path::PathBuf {
        self.dir().join(format!("{name}.log"))
    }

    /// Everything `name` has logged so far.
    pub fn log(&self, name: &str) -> String {
        std::fs::read_to_string(self.log_path(name)).unwrap_or_default()
    }

    /// Starts `cmd` as `name`, its stdout and stderr appended to `NAME.log` and its stdin
    /// empty. Returns the child.
    pub fn spawn(
        &mut self,
        name: &str,
        cmd: &mut std::process::Command,
    ) -> &mut std::process::Child {
        use std::io::Write as _;
        let path = self.log_path(name);
        let mut log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .unwrap();
        let _ = writeln!(log, "=== {name}: {cmd:?}");
        let child = cmd
            .stdin(std::process::Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("starting {name}: {e}"));
        self.nodes.push((name.to_string(), child, path));
        &mut self.nodes.last_mut().unwrap().1
    }

    /// The child last started as `name`.
    ///
    /// # Panics
    /// When there is none.
    pub fn child(&mut self, name: &str) -> &mut std::process::Child {
        let i = self.index(name);
        &mut self.nodes[i].1
    }

    fn index(&self, name: &str) -> usize {
        self.nodes
            .iter()
            .rposition(|(n, _, _)| n == name)
            .unwrap_or_else(|| panic!("no process `{name}`"))
    }

    /// Marks the child last started as `name` as stopped by the test (it may exit now without
    /// failing [`Procs::assert_running`]), and returns it.
    pub fn stopping(&mut self, name: &str) -> &mut std::process::Child {
        let i = self.index(name);
        self.stopped.push(i);
        &mut self.nodes[i].1
    }

    /// SIGKILLs the child last started as `name` and reaps it (its log stays, for a failure
    /// report).
    pub fn kill(&mut self, name: &str) {
        let child = self.stopping(name);
        let _ = child.kill();
        let _ = child.wait();
    }

    /// The tail of `name`'s log, headed by its name and log path.
    pub fn tail(&self, name: &str) -> String {
        let path = self.log_path(name);
        format!(
            "--- {name} ({}; last {LOG_TAIL_LINES} lines) ---\n{}",
            path.display(),
            log_tail(&path, LOG_TAIL_LINES)
        )
    }

    /// The first process that exited although it was not stopped by the test: its name, exit
    /// status and log tail. Processes the test stopped ([`Procs::kill`], [`Procs::stopping`])
    /// are not counted.
    pub fn exited(&mut self) -> Option<String> {
        let mut found = None;
        for (i, (name, child, _)) in self.nodes.iter_mut().enumerate() {
            if self.stopped.contains(&i) {
                continue;
            }
            if let Ok(Some(status)) = child.try_wait() {
                found = Some((name.clone(), status));
                break;
            }
        }
        let (name, status) = found?;
        Some(format!("{name} exited ({status})\n{}", self.tail(&name)))
    }

    /// Fails the test, with the log of the process, when one has exited (see
    /// [`Procs::exited`]).
    pub fn assert_running(&mut self) {
        if let Some(report) = self.exited() {
            panic!("a process exited before the test stopped it: {report}");
        }
    }
}

impl Drop for Procs {
    fn drop(&mut self) {
        stop_nodes(&mut self.nodes);
        if std::thread::panicking() {
            if let Some(dir) = self.dir.take() {
                eprintln!("--- logs kept in {}", dir.keep().display());
            }
        }
    }
}

/// Sends `sig` to `child`, which must not have been reaped.
///
/// # Panics
/// When `child` has exited, or the signal cannot be sent.
pub fn signal(child: &mut std::process::Child, sig: i32) {
    assert!(
        matches!(child.try_wait(), Ok(None)),
        "process {} has exited",
        child.id()
    );
    // SAFETY: signalling our own child, which has not been reaped.
    let rc = unsafe { libc::kill(child.id() as i32, sig) };
    assert_eq!(
        rc,
        0,
        "kill({}, {sig}): {}",
        child.id(),
        std::io::Error::last_os_error()
    );
}

/// SIGTERMs `child` and waits (at most 30 s) for it to exit; its exit status.
pub fn sigterm_and_wait(child: &mut std::process::Child) -> std::process::ExitStatus {
    // SAFETY: signalling our own child.
    unsafe {
        libc::kill(child.id() as i32, libc::SIGTERM);
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{} did not stop",
            child.id()
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// Waits (at most 10 s) until no process carries `tag`; fails naming those left behind.
pub fn assert_none_left(tag: &str) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !tagged_processes(tag).is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "processes left behind: {:?}",
            tagged_processes(tag)
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// Writes a deployment file at `path`: cluster `name` serving `model` over tcp, a proxy on
/// 127.0.0.1:`proxy` (with its control plane on UDP `control` and `credentials_dir = creds`
/// when given), and one instance per `(name, role, port)` of `instances`, one thread each.
pub fn write_deployment(
    path: &std::path::Path,
    name: &str,
    model: &str,
    creds: Option<(&std::path::Path, u16)>,
    proxy: u16,
    instances: &[(&str, &str, u16)],
) {
    use std::fmt::Write as _;
    let mut s = format!("[cluster]\nname = \"{name}\"\nmodel = \"{model}\"\ntransport = \"tcp\"\n");
    if let Some((dir, _)) = creds {
        let _ = writeln!(s, "credentials_dir = \"{}\"", dir.display());
    }
    let _ = write!(
        s,
        "\n[[node]]\nname = \"proxy\"\nrole = \"proxy\"\nhost = \"127.0.0.1\"\nport = {proxy}\n"
    );
    if let Some((_, control)) = creds {
        let _ = writeln!(s, "control_port = {control}");
    }
    for (node, role, port) in instances {
        let _ = write!(
            s,
            "\n[[node]]\nname = \"{node}\"\nrole = \"{role}\"\nhost = \"127.0.0.1\"\nport = {port}\nthreads = 1\n"
        );
    }
    std::fs::write(path, s).unwrap();
}
