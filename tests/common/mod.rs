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
