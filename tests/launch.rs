//! `pdserve launch` end to end: start a single-node 1P1D cluster, serve one streamed chat
//! request through its proxy, stop it with SIGTERM, and find no process left behind.

mod common;

use common::{assert_none_left, inspect, sigterm_and_wait, tagged_processes};
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

/// `pdserve launch` of a 1P1D synthetic cluster on a free port, its environment carrying `tag`.
fn launch_tagged(tag: &str, extra: &[&str]) -> std::process::Child {
    let (key, value) = tag.split_once('=').unwrap();
    Command::new(env!("CARGO_BIN_EXE_pdserve"))
        .args([
            "launch",
            "--model",
            "synthetic:tiny",
            "--port",
            "0",
            "--threads",
            "1",
        ])
        .args(extra)
        .env(key, value)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap()
}

#[test]
fn launch_serves_a_streamed_chat_and_stops_cleanly_on_sigterm() {
    let tag = format!("PDSERVE_TEST_LAUNCH_TAG={}", std::process::id());
    let mut launcher = launch_tagged(&tag, &[]);
    // The proxy URL arrives on a line of its own.
    let mut lines = BufReader::new(launcher.stdout.take().unwrap()).lines();
    let url = lines.next().expect("launcher printed nothing").unwrap();
    assert!(url.starts_with("http://127.0.0.1:"), "{url}");
    assert!(
        tagged_processes(&tag).len() >= 4,
        "launcher + prefill + decode + proxy"
    );

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let body = rt.block_on(async {
        let r = pdserve_actors::http::http_client().build().unwrap()
            .post(format!("{url}/v1/chat/completions"))
            .json(&serde_json::json!({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 6, "ignore_eos": true, "stream": true}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        assert!(r.headers()["content-type"].to_str().unwrap().starts_with("text/event-stream"));
        r.text().await.unwrap()
    });
    let events: Vec<&str> = body
        .split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .collect();
    assert_eq!(
        events.last().map(|e| e.trim()),
        Some("data: [DONE]"),
        "{body}"
    );
    let finish = events
        .iter()
        .filter_map(|e| e.trim().strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str::<serde_json::Value>(d).unwrap())
        .filter_map(|v| {
            v["choices"][0]["finish_reason"]
                .as_str()
                .map(str::to_string)
        })
        .next_back();
    assert_eq!(finish.as_deref(), Some("length"));

    // SIGTERM: everything stops, in bounded time, leaving nothing behind.
    let status = sigterm_and_wait(&mut launcher);
    assert!(status.success(), "{status}");
    assert_none_left(&tag);
}

#[test]
fn inspect_lists_the_proxy_and_every_launched_instance_and_one_api_key_guards_them() {
    const KEY: &str = "sk-launch-5e1d";
    let tag = format!("PDSERVE_TEST_LAUNCH_INSPECT_TAG={}", std::process::id());
    let mut launcher = launch_tagged(&tag, &["--api-key", KEY]);
    // Stops the launcher however this test ends.
    struct Stop(u32);
    impl Drop for Stop {
        fn drop(&mut self) {
            // SAFETY: signalling our own child.
            unsafe {
                libc::kill(self.0 as i32, libc::SIGTERM);
            }
        }
    }
    let _stop = Stop(launcher.id());
    let mut lines = BufReader::new(launcher.stdout.take().unwrap()).lines();
    let url = lines.next().expect("launcher printed nothing").unwrap();
    assert!(url.starts_with("http://127.0.0.1:"), "{url}");
    let line = lines.next().expect("no inspect line").unwrap();
    // `inspect: pdserve inspect ADDR --credentials-dir DIR`
    let words: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(&words[..3], ["inspect:", "pdserve", "inspect"], "{line}");
    assert_eq!(words[4], "--credentials-dir", "{line}");
    let (addr, dir) = (words[3].to_string(), words[5].to_string());
    assert!(std::path::Path::new(&dir).join("ca.crt").exists(), "{dir}");

    let (ok, out, err) = inspect(&[&addr, "--credentials-dir", &dir, "--json"]);
    assert!(ok, "inspect failed: {err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["proxy"]["node"], "proxy", "{v}");
    assert_eq!(v["proxy"]["url"], url.as_str(), "{v}");
    assert_eq!(v["proxy"]["actors"]["kind"], "Proxy", "{v}");
    let instances = v["instances"].as_array().unwrap();
    let mut nodes: Vec<&str> = instances
        .iter()
        .map(|m| m["node"].as_str().unwrap())
        .collect();
    nodes.sort_unstable();
    assert_eq!(nodes, ["decode-0", "prefill-0"], "{v}");
    for m in instances {
        assert_eq!(m["routable"], true, "{m}");
        let snap = &m["snapshot"];
        assert_eq!(snap["instance"], m["node"], "{m}");
        assert_eq!(snap["actors"]["kind"], "InstanceSupervisor", "{m}");
        let kinds: Vec<&str> = snap["actors"]["children"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["kind"].as_str().unwrap())
            .collect();
        for kind in ["Scheduler", "TpWorker", "HttpFrontend"] {
            assert!(kinds.contains(&kind), "{kind} missing: {m}");
        }
    }

    // `--api-key`: the proxy and every instance require the key on `/v1/*`; disaggregated
    // requests work with it (the proxy and decode send it on); the children got it in their
    // environment, not on their command lines.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let http = pdserve_actors::http::http_client().build().unwrap();
        let body = serde_json::json!({"prompt": "hello", "max_tokens": 4, "ignore_eos": true});
        let r = http
            .post(format!("{url}/v1/completions"))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 401, "the proxy without the key");
        let r = http
            .post(format!("{url}/v1/completions"))
            .bearer_auth(KEY)
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
        for m in instances {
            let info = format!("{}/v1/kv/info", m["url"].as_str().unwrap());
            let r = http.get(&info).send().await.unwrap();
            assert_eq!(r.status(), 401, "{info} without the key");
            let r = http.get(&info).bearer_auth(KEY).send().await.unwrap();
            assert_eq!(r.status(), 200, "{info} with the key");
        }
    });
    for pid in tagged_processes(&tag) {
        if pid == launcher.id() {
            continue;
        }
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        assert!(
            !String::from_utf8_lossy(&cmdline).contains(KEY),
            "the key is on a child's command line"
        );
    }

    // The tree, with the address taken from the credentials directory.
    let (ok, out, err) = inspect(&["--credentials-dir", &dir]);
    assert!(ok, "inspect failed: {err}");
    assert!(
        out.starts_with("cluster pdserve-launch proxy=proxy"),
        "{out}"
    );
    for needle in [
        "prefill-0 (prefill) routable",
        "decode-0 (decode) routable",
        "[TpWorker] running",
    ] {
        assert!(out.contains(needle), "{needle} missing:\n{out}");
    }
    assert!(
        !out.contains('\x1b'),
        "no colour when stdout is not a terminal"
    );

    // Nothing listens there: a clear error and a non-zero exit.
    let silent = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let nowhere = silent.local_addr().unwrap().to_string();
    let (ok, _, err) = inspect(&[&nowhere, "--credentials-dir", &dir]);
    assert!(!ok);
    assert!(err.contains(&format!("cannot reach {nowhere}")), "{err}");

    // SIGTERM: the launcher stops and removes its credentials.
    let status = sigterm_and_wait(&mut launcher);
    assert!(status.success(), "{status}");
    assert!(!std::path::Path::new(&dir).exists(), "{dir} left behind");
    assert_none_left(&tag);
}

/// The CPUs in a `Cpus_allowed_list` line of `/proc/PID/status` (`0-3,8,10-11`).
fn allowed_cpus(pid: &str) -> Vec<usize> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let list = status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .unwrap()
        .trim();
    list.split(',')
        .flat_map(|r| match r.split_once('-') {
            Some((a, b)) => a.parse::<usize>().unwrap()..=b.parse().unwrap(),
            None => r.parse::<usize>().unwrap()..=r.parse().unwrap(),
        })
        .collect()
}

#[test]
fn pin_cpus_gives_each_instance_its_own_cpus() {
    let tag = format!("PDSERVE_TEST_LAUNCH_PIN_TAG={}", std::process::id());
    let ours = allowed_cpus("self");
    let mut launcher = launch_tagged(&tag, &["--pin-cpus"]);
    if ours.len() < 2 {
        // One CPU cannot be split between two instances: refused, nothing started.
        let status = launcher.wait().unwrap();
        assert!(!status.success(), "{status}");
        assert_none_left(&tag);
        return;
    }
    let mut lines = BufReader::new(launcher.stdout.take().unwrap()).lines();
    let url = lines.next().expect("launcher printed nothing").unwrap();
    assert!(url.starts_with("http://127.0.0.1:"), "{url}");
    let mut sets = Vec::new();
    for pid in tagged_processes(&tag) {
        let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
            continue;
        };
        let args: Vec<&[u8]> = cmdline.split(|&b| b == 0).collect();
        if let Some(i) = args.iter().position(|a| *a == b"--role") {
            let role = String::from_utf8_lossy(args[i + 1]).into_owned();
            sets.push((role, allowed_cpus(&pid.to_string())));
        }
    }
    sets.sort();
    let roles: Vec<&str> = sets.iter().map(|(r, _)| r.as_str()).collect();
    assert_eq!(roles, ["decode", "prefill"], "{sets:?}");
    let (decode, prefill) = (&sets[0].1, &sets[1].1);
    assert_eq!(decode.len(), ours.len() / 2, "{sets:?} of {ours:?}");
    assert_eq!(prefill.len(), ours.len() / 2, "{sets:?} of {ours:?}");
    assert!(
        decode
            .iter()
            .all(|c| !prefill.contains(c) && ours.contains(c)),
        "{sets:?}"
    );
    assert!(prefill.iter().all(|c| ours.contains(c)), "{sets:?}");
    let status = sigterm_and_wait(&mut launcher);
    assert!(status.success(), "{status}");
    assert_none_left(&tag);
}
