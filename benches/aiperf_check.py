#!/usr/bin/env python3
"""NVIDIA AIPerf (`aiperf profile`) against `pdserve launch` (1P1D by default): chat, streaming,
a shared system prompt in front of every request (issue 29).

The run passes when AIPerf completes every request with zero errors and reports non-zero
prompt cache-read tokens (`usage.prompt_tokens_details.cached_tokens`, which AIPerf reads with
`--use-server-token-count`). AIPerf counts tokens with a Hugging Face tokenizer; for a GGUF
model `pdserve model tokenizer` writes one (AIPerf's `builtin` tokenizer would download).

usage: benches/aiperf_check.py [--pdserve PATH] [--model MODEL] [--requests 32]
           [--concurrency 4] [--system-tokens 500] [--input-tokens 64] [--output-tokens 32]
           [--launch-args "--prefill 1 --decode 1"] [--out DIR]

Installs `aiperf` (pinned) from PyPI into a venv under $PDSERVE_HOME/venvs on first use.
Prints AIPerf's summary figures as one JSON line; exits non-zero if the check fails.
"""
import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pyenv  # noqa: E402

pyenv.ensure(["aiperf==0.13.0"])


def avg(report, key):
    v = report.get(key)
    return v.get("avg") if isinstance(v, dict) else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pdserve", help="pdserve binary (default: cargo build --release)")
    ap.add_argument("--model", default="default")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=500)
    ap.add_argument("--input-tokens", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--launch-args", default="", help="more `pdserve launch` flags")
    ap.add_argument("--out", help="AIPerf artifact directory (default: a temp dir)")
    args = ap.parse_args()
    binary = pyenv.pdserve_binary(args.pdserve)
    out = args.out or tempfile.mkdtemp(prefix="aiperf-")
    tokenizer = os.path.join(out, "tokenizer")
    subprocess.run([binary, "model", "tokenizer", "--model", args.model, "--out", tokenizer],
                   check=True, stdout=subprocess.DEVNULL)
    cluster = pyenv.Cluster(binary, ["--model", args.model, *shlex.split(args.launch_args)],
                            log=os.path.join(out, "launch.log"))
    try:
        model = json.loads(pyenv.get(cluster.url + "/v1/models"))["data"][0]["id"]
        argv = [os.path.join(os.path.dirname(sys.executable), "aiperf"), "profile",
                "--model", model, "--url", cluster.url, "--endpoint-type", "chat", "--streaming",
                "--tokenizer", tokenizer, "--use-server-token-count",
                "--shared-system-prompt-length", str(args.system_tokens),
                "--prompt-input-tokens-mean", str(args.input_tokens),
                "--prompt-output-tokens-mean", str(args.output_tokens),
                "--request-count", str(args.requests), "--concurrency", str(args.concurrency),
                "--random-seed", "1", "--ui-type", "none",
                "--output-artifact-dir", os.path.join(out, "aiperf")]
        print("running:", shlex.join(argv), file=sys.stderr, flush=True)
        run = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             timeout=1800)
        with open(os.path.join(out, "aiperf.txt"), "w") as f:
            f.write(run.stdout)
    finally:
        cluster.stop()
    if run.returncode != 0:
        sys.exit(f"aiperf exited with {run.returncode}; its output is in {out}/aiperf.txt")
    with open(os.path.join(out, "aiperf", "profile_export_aiperf.json")) as f:
        report = json.load(f)
    summary = {
        "requests": avg(report, "request_count"),
        "error_rate_pct": avg(report, "request_error_rate"),
        "errors": report.get("error_summary"),
        "cached_tokens_total": avg(report, "total_usage_prompt_cache_read_tokens"),
        "cached_pct": avg(report, "overall_usage_prompt_cache_read_pct"),
        "prompt_tokens_avg": avg(report, "usage_prompt_tokens"),
        "ttft_ms_p50": (report.get("time_to_first_token") or {}).get("p50"),
        "itl_ms_p50": (report.get("inter_token_latency") or {}).get("p50"),
        "output_tok_s": avg(report, "output_token_throughput"),
        "artifacts": out,
    }
    print(json.dumps(summary))
    ok = (summary["requests"] == args.requests and not summary["errors"]
          and (summary["error_rate_pct"] or 0) == 0 and (summary["cached_tokens_total"] or 0) > 0)
    print(("ok  " if ok else "FAIL") + f" aiperf: {summary['requests']} requests, "
          f"errors {summary['errors'] or 0}, cached tokens {summary['cached_tokens_total']} "
          f"({summary['cached_pct']}% of prompt tokens)")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
