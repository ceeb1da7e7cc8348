#!/usr/bin/env python3
"""Logprob-level agreement with llama.cpp: `pdserve serve` against `llama-server`, same GGUF.

llama.cpp is the oracle. For every prompt the script asks llama-server (`/completion`,
`n_probs`) and pdserve (`/v1/completions`, `logprobs`) for the same greedy continuation of the
same token ids (llama-server tokenizes, so tokenization is not part of the comparison) and
compares, step by step: the chosen token id, and the top-5 log-probabilities rank by rank.
Both report raw log-probabilities (log-softmax of the logits before any sampler; llama-server
with `post_sampling_probs: false`, pdserve by vLLM's `raw_logprobs` convention).

Prompts: chat (rendered by llama-server's own chat template) and raw text, short and
300–3000 tokens, prose, code, numbers, French, German, Spanish; 32 greedy steps each,
end-of-generation tokens not stopping either server.

usage: logprobs_vs_llamaserver.py --llama-server PATH [--model GGUF] [--pdserve PATH]
           [--weights auto,native] [--kv f32] [--steps 32] [--json OUT] [--llama-kv-too f16]

Per (weights, kv) configuration it prints a table row per prompt (first step where the
chosen tokens differ, largest top-5 difference over the steps before it, count of steps with
every top-5 difference ≤ 0.01) and a JSON line with every number.
"""
import argparse
import json
import os
import random
import sys
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pyenv import Server, free_port  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
TOLERANCE = 0.01
TOP = 5


def post(url, body, timeout=600):
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def read(path, limit):
    with open(os.path.join(REPO, path), encoding="utf-8") as f:
        return f.read()[:limit]


def prompts():
    """(name, kind, text) — kind is `chat` (a user message) or `raw` (text as is)."""
    prose = read("docs/architecture.md", 60000)
    code = read("gpu/src/attention.rs", 60000)
    rng = random.Random(7)
    numbers = ", ".join(str(rng.randint(0, 99999)) for _ in range(220))
    return [
        ("chat-short", "chat", "What is the capital of France? Answer in one sentence."),
        ("chat-code", "chat", "Write a Python function that returns the n-th Fibonacci number."),
        ("chat-long", "chat", "Summarize the following design notes.\n\n" + prose[:6000]),
        ("raw-prose-short", "raw", "The old lighthouse keeper climbed the stairs every evening"),
        ("raw-prose-355", "raw", prose[2000:3600]),
        ("raw-prose-3000", "raw", prose[:12500]),
        ("raw-code-rust", "raw", code[:2400]),
        ("raw-numbers", "raw", "Here is a list of measurements: " + numbers),
        ("raw-arithmetic", "raw", "12 + 7 = 19\n45 - 18 = 27\n6 * 8 = 48\n81 / 9 = 9\n23 + 59 ="),
        ("raw-french", "raw", "Il était une fois, dans un petit village au bord de la mer, "
                              "une vieille femme qui vendait du pain. Chaque matin,"),
        ("raw-german", "raw", "Die Bundesrepublik Deutschland ist ein Bundesstaat in "
                              "Mitteleuropa. Ihre Hauptstadt ist"),
        ("chat-spanish", "chat", "¿Cuáles son los tres ríos más largos de Europa? Responde en español."),
    ]


def llama_tokens(base, kind, text):
    if kind == "chat":
        text = post(base + "/apply-template",
                    {"messages": [{"role": "user", "content": text}]})["prompt"]
    return post(base + "/tokenize", {"content": text, "add_special": False,
                                     "parse_special": kind == "chat"})["tokens"]


def llama_run(base, ids, steps):
    r = post(base + "/completion", {
        "prompt": ids, "n_predict": steps, "temperature": 0, "top_k": 1,
        "n_probs": TOP, "post_sampling_probs": False, "ignore_eos": True,
        "cache_prompt": False, "samplers": ["top_k"],
    })
    # llama-server reports one entry per piece of whole UTF-8 characters: a character split
    # over several tokens (common in Chinese) would merge steps, so such prompts are refused.
    if len(r["completion_probabilities"]) != steps:
        sys.exit("llama-server merged tokens of split UTF-8 characters; choose another prompt")
    out = []
    for p in r["completion_probabilities"]:
        top = sorted((t["logprob"] for t in p["top_logprobs"]), reverse=True)[:TOP]
        out.append((p["id"], top))
    return out


def pdserve_run(base, model, ids, steps):
    r = post(base + "/v1/completions", {
        "model": model, "prompt": ids, "max_tokens": steps, "temperature": 0,
        "logprobs": TOP, "ignore_eos": True, "return_token_ids": True,
    })
    choice = r["choices"][0]
    out = []
    for tid, alts in zip(choice["token_ids"], choice["logprobs"]["top_logprobs"]):
        out.append((tid, sorted(alts.values(), reverse=True)[:TOP]))
    return out


def compare(ref, got):
    """First step whose chosen tokens differ (None if none), the largest top-5 difference (by
    rank) over the steps up to and including it (after it the two continue different texts),
    and how many of those steps stay within TOLERANCE everywhere."""
    first_diff, worst, within = None, 0.0, 0
    for step, ((rid, rtop), (gid, gtop)) in enumerate(zip(ref, got)):
        n = min(len(rtop), len(gtop))
        d = max((abs(a - b) for a, b in zip(rtop[:n], gtop[:n])), default=0.0)
        worst = max(worst, d)
        within += d <= TOLERANCE
        if rid != gid:
            first_diff = step
            break
    return first_diff, worst, within


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--model", default=os.path.join(
        os.environ.get("PDSERVE_HOME", os.path.expanduser("~/.cache/pdserve")),
        "models", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--pdserve", default=os.path.join(REPO, "target/release/pdserve"))
    ap.add_argument("--weights", default="auto,native")
    ap.add_argument("--kv", default="f32", help="KV dtype of both servers: f32 or f16")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--json", help="append one JSON line per configuration to this file")
    ap.add_argument("--llama-kv-too", metavar="KV",
                    help="also compare llama-server with this KV dtype (e.g. f16, its default) "
                         "against itself with --kv: llama.cpp's own spread, for scale")
    args = ap.parse_args()

    def llama_cases(kv):
        lport = free_port()
        lbase = f"http://127.0.0.1:{lport}"
        # One slot, f32 (or f16) KV, flash attention off (pdserve's attention is the plain
        # softmax), weights not repacked (pdserve's kernels follow the unrepacked float order).
        llama = Server([args.llama_server, "-m", args.model, "-t", "2", "-np", "1", "-c", "4096",
                        "-ctk", kv, "-ctv", kv, "-fa", "off", "--no-repack", "-to", "600",
                        "--host", "127.0.0.1", "--port", str(lport)], lbase + "/health",
                       "llama-server")
        try:
            cases = []
            for name, kind, text in prompts():
                ids = llama_tokens(lbase, kind, text)
                print(f"# llama-server {kv}: {name} ({len(ids)} tokens)", file=sys.stderr,
                      flush=True)
                cases.append((name, kind, ids, llama_run(lbase, ids, args.steps)))
            return cases
        finally:
            llama.stop()

    cases = llama_cases(args.kv)
    configs = []
    if args.llama_kv_too:
        other = {name: run for name, _, _, run in llama_cases(args.llama_kv_too)}
        configs.append((f"llama-server KV {args.llama_kv_too}", lambda name, ids: other[name]))

    def table(label, run):
        rows = []
        for name, kind, ids, ref in cases:
            first_diff, worst, within = compare(ref, run(name, ids))
            rows.append({"prompt": name, "kind": kind, "prompt_tokens": len(ids),
                         "steps": len(ref), "first_token_difference": first_diff,
                         "max_top5_abs_diff": worst, "steps_within_tolerance": within})
        print(f"\n## {label}: top-{TOP} logprobs against llama-server KV {args.kv} "
              f"(tolerance {TOLERANCE})\n")
        print("| prompt | tokens | tokens equal | max top-5 \\|Δ\\| | steps within 0.01 |")
        print("|---|---|---|---|---|")
        for r in rows:
            same = ("all %d" % r["steps"] if r["first_token_difference"] is None
                    else "first %d" % r["first_token_difference"])
            print(f"| {r['prompt']} | {r['prompt_tokens']} | {same} | "
                  f"{r['max_top5_abs_diff']:.4f} | {r['steps_within_tolerance']} |")
        line = json.dumps({"config": label, "kv": args.kv, "steps": args.steps, "rows": rows})
        print(line, flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(line + "\n")

    for label, run in configs:
        table(label, run)
    for weights in args.weights.split(","):
        pport = free_port()
        pbase = f"http://127.0.0.1:{pport}"
        env = dict(os.environ, PDSERVE_SCHEDULER__KV_CACHE_DTYPE=args.kv)
        pd = Server([args.pdserve, "serve", "--model", args.model, "--weights", weights,
                     "--threads", "2", "--host", "127.0.0.1", "--port", str(pport)],
                    pbase + "/v1/models", "pdserve", env=env)
        try:
            with urllib.request.urlopen(pbase + "/v1/models", timeout=10) as r:
                model = json.loads(r.read())["data"][0]["id"]
            table(f"pdserve --weights {weights}, KV {args.kv}",
                  lambda name, ids: pdserve_run(pbase, model, ids, args.steps))
        finally:
            pd.stop()


if __name__ == "__main__":
    main()
