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

/// A free TCP port on 127.0.0.1.
pub fn free_tcp_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A free UDP port on 127.0.0.1 (the control plane is QUIC).
pub fn free_udp_port() -> u16 {
    std::net::UdpSocket::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Stops node processes `(name, child, log file)`: SIGTERM to all, then up to 10 s each to
/// exit before SIGKILL. When the test is panicking, prints the end of each node's log.
pub fn stop_nodes<N: std::fmt::Display>(
    nodes: &mut [(N, std::process::Child, std::path::PathBuf)],
) {
    for (_, child, _) in nodes.iter() {
        // SAFETY: signalling our own children.
        unsafe {
            libc::kill(child.id() as i32, libc::SIGTERM);
        }
    }
    for (node, child, log) in nodes.iter_mut() {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while child.try_wait().ok().flatten().is_none() && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
        if std::thread::panicking() {
            let text = std::fs::read_to_string(&*log).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            eprintln!("--- {node} log (last 60 lines) ---");
            for l in &lines[lines.len().saturating_sub(60)..] {
                eprintln!("{l}");
            }
        }
    }
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
