//! `pdserve plan`: a trace written by `plan trace` is read back by `plan simulate --trace
//! FILE`, which prints the planner beside the best fixed split; bad input is refused by name.
//! Small traces (60 s), so each run takes well under a second.

use std::process::Command;

fn pdserve(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_pdserve"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("pdserve runs")
}

#[test]
fn a_generated_trace_round_trips_through_jsonl_into_the_simulator() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("trace.jsonl");
    let out = pdserve(&[
        "plan",
        "trace",
        "multi-turn",
        "--duration-s",
        "60",
        "--seed",
        "5",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let jsonl = String::from_utf8(out.stdout).unwrap();
    assert!(jsonl.lines().count() > 50, "{jsonl}");
    assert!(
        jsonl.contains("\"prefix\""),
        "follow-up turns carry their prefix"
    );
    std::fs::write(&path, &jsonl).unwrap();
    let out = pdserve(&[
        "plan",
        "simulate",
        "--curves",
        "configs/planner/smollm2-135m-cpu.toml",
        "--trace",
        path.to_str().unwrap(),
        "--fixed-prefill",
        "1:3",
        "--fixed-decode",
        "1:3",
        "--windows",
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let requests = jsonl.lines().count().to_string();
    assert!(text.contains(&format!("{requests} requests")), "{text}");
    assert!(text.contains("planner (throughput)"), "{text}");
    assert!(
        text.contains("best fixed split") || text.contains("no fixed split"),
        "{text}"
    );
    assert!(text.contains("planner windows:"), "{text}");
}

#[test]
fn bad_traces_and_curves_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("bad.jsonl");
    std::fs::write(
        &trace,
        "{\"t\": 1.0, \"isl\": 10, \"osl\": 5}\n{\"t\": 2.0, \"isl\": 0, \"osl\": 5}\n",
    )
    .unwrap();
    let out = pdserve(&[
        "plan",
        "simulate",
        "--curves",
        "configs/planner/smollm2-135m-cpu.toml",
        "--trace",
        trace.to_str().unwrap(),
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("isl and osl must be >= 1"), "{err}");
    let curves = dir.path().join("curves.toml");
    std::fs::write(&curves, "prefill = []\ndecode = []\nhandoff = []\n[engine]\nmax_batch = 8\nkv_capacity_tokens = 100\nkv_bytes_per_token = 1\nstartup_s = 1\n").unwrap();
    let out = pdserve(&[
        "plan",
        "simulate",
        "--curves",
        curves.to_str().unwrap(),
        "--trace",
        "shifting",
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no [[prefill]] point"), "{err}");
    let out = pdserve(&[
        "plan",
        "simulate",
        "--curves",
        "configs/planner/smollm2-135m-cpu.toml",
        "--trace",
        "shifting",
        "--mode",
        "fast",
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("expected throughput or load"));
}
