#!/usr/bin/env python3
"""EleutherAI's lm-evaluation-harness (`lm_eval --model local-completions`) on a log-likelihood
task, against pdserve and against llama.cpp on the same GGUF (issue 29).

The task is multiple choice over the shipped `benches/data/lm_eval_mc.jsonl` (139 questions:
capitals, arithmetic, opposites, animal sounds, colours; four choices each): the harness scores
each choice by the log-likelihood of its tokens after the question, which it gets from
`/v1/completions` with `echo: true, logprobs: 1, max_tokens: 1` (prompt log-probabilities).
Prompts go as text (`tokenized_requests=False`),
as both servers tokenize with the GGUF's tokenizer.

The llama.cpp side: neither of llama.cpp's servers can answer these requests as the OpenAI API
does. `llama-server` refuses them ("Only no echo is supported"); `llama-cpp-python[server]`
0.3.36 leaves the sampled token out of `echo` log-probabilities, and the harness drops the last
entry, so every one-token continuation scored 0 there (302 of 556; accuracy 19 %, below chance).
The oracle is therefore llama.cpp's own logits on the same GGUF, evaluated by llama-cpp-python's
`Llama` (the library under its server, built from the PyPI sdist with the flags below) and
answered by `benches/llama_cpp_logprobs.py`, a thin `/v1/completions` that puts log-softmax of
those logits in OpenAI's shape. Same harness, same task, same tokenizer files.

Passes when pdserve's accuracy is within 1 point of llama.cpp's. Also reports how many of the
questions the two answer differently and the largest per-choice log-likelihood difference.

usage: benches/lm_eval_check.py [--pdserve PATH] [--colocated] [--threads 2] [--out DIR]
           [--llama-cmake-args "..."]

Installs `lm-eval` and `transformers` (pinned; the tokenizer files come from
`pdserve model tokenizer`) and, in a second venv, `llama-cpp-python` from PyPI on first
use (the latter compiles llama.cpp: several minutes).
"""
import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pyenv  # noqa: E402

pyenv.ensure(["lm-eval[api]==0.4.13", "transformers==5.24.0"])

TASK = "pdserve_mc"
DATASET = os.path.join(pyenv.HERE, "data", "lm_eval_mc.jsonl")
# AMX instructions fault in this project's reference VM (see docs/benchmarks.md).
AMX_OFF = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
DEFAULT_CMAKE = f"-DGGML_NATIVE=ON -DCMAKE_C_FLAGS='{AMX_OFF}' -DCMAKE_CXX_FLAGS='{AMX_OFF}'"


def task_dir(out):
    d = os.path.join(out, "tasks")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, f"{TASK}.yaml"), "w") as f:
        f.write(f"""task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {DATASET}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""")
    return d


def run_harness(name, url, model, tokenizer, tasks, out):
    """One `lm_eval` run; returns (accuracy, {doc_id: [log-likelihood per choice]})."""
    dest = os.path.join(out, name)
    argv = [os.path.join(os.path.dirname(sys.executable), "lm_eval"),
            "--model", "local-completions",
            "--model_args", f"model={model},base_url={url}/v1/completions,tokenizer={tokenizer},"
                            "tokenizer_backend=huggingface,tokenized_requests=False,"
                            "num_concurrent=1,max_retries=1",
            "--tasks", TASK, "--include_path", tasks, "--output_path", dest, "--log_samples"]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    with open(dest + ".log", "w") as log:
        r = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=3600)
    if r.returncode != 0:
        sys.exit(f"lm_eval against {name} exited with {r.returncode}; see {dest}.log")
    return read_results(dest)


def read_results(dest):
    """(accuracy, {doc_id: [log-likelihood per choice]}) of a finished `lm_eval` run."""
    results = json.load(open(glob.glob(f"{dest}/**/results_*.json", recursive=True)[0]))
    acc = results["results"][TASK]["acc,none"]
    scores = {}
    for path in glob.glob(f"{dest}/**/samples_{TASK}_*.jsonl", recursive=True):
        for line in open(path):
            s = json.loads(line)
            scores[s["doc_id"]] = [float(r[0]) for r in s["filtered_resps"]]
    return acc, scores


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pdserve", help="pdserve binary (default: cargo build --release)")
    ap.add_argument("--colocated", action="store_true",
                    help="`pdserve serve` instead of `pdserve launch` (1P1D)")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    ap.add_argument("--llama-cmake-args", default=DEFAULT_CMAKE)
    ap.add_argument("--out", help="results directory (default: a temp dir)")
    ap.add_argument("--llama-results", metavar="DIR",
                    help="reuse the llama.cpp run of an earlier --out DIR (same dataset) "
                         "instead of running llama.cpp again")
    args = ap.parse_args()
    binary = pyenv.pdserve_binary(args.pdserve)
    out = args.out or tempfile.mkdtemp(prefix="lm-eval-")
    gguf = subprocess.run([binary, "model", "pull"], check=True, capture_output=True,
                          text=True).stdout.strip()
    tokenizer = os.path.join(out, "tokenizer")
    subprocess.run([binary, "model", "tokenizer", "--out", tokenizer], check=True,
                   stdout=subprocess.DEVNULL)
    tasks = task_dir(out)
    # pdserve, then llama.cpp: one server on the machine at a time.
    if args.colocated:
        server, url = pyenv.serve(binary, log=os.path.join(out, "pdserve.log"))
    else:
        server = pyenv.Cluster(binary, log=os.path.join(out, "pdserve.log"))
        url = server.url
    try:
        model = json.loads(pyenv.get(url + "/v1/models"))["data"][0]["id"]
        pd_acc, pd_scores = run_harness("pdserve", url, model, tokenizer, tasks, out)
    finally:
        server.stop()
    if args.llama_results:
        ll_acc, ll_scores = read_results(os.path.join(args.llama_results, "llama.cpp"))
    else:
        oracle = pyenv.venv_python(["llama-cpp-python==0.3.36"],
                                   {"CMAKE_ARGS": args.llama_cmake_args,
                                    "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count())})
        ll_acc, ll_scores = run_llama(oracle, gguf, model, tokenizer, tasks, out, args.threads)
    compare(pd_acc, pd_scores, ll_acc, ll_scores, out, args)


def run_llama(oracle, gguf, model, tokenizer, tasks, out, threads):
    """The harness against llama.cpp (benches/llama_cpp_logprobs.py) on the same GGUF."""
    port = pyenv.free_port()
    llama_url = f"http://127.0.0.1:{port}"
    llama = pyenv.Server([oracle, os.path.join(pyenv.HERE, "llama_cpp_logprobs.py"),
                          "--model", gguf, "--alias", model, "--port", str(port),
                          "--n-ctx", "2048", "--threads", str(threads)],
                         llama_url + "/v1/models", "llama.cpp (llama_cpp_logprobs.py)",
                         os.path.join(out, "llama.log"))
    try:
        return run_harness("llama.cpp", llama_url, model, tokenizer, tasks, out)
    finally:
        llama.stop()


def compare(pd_acc, pd_scores, ll_acc, ll_scores, out, args):
    differ = [d for d in pd_scores if d in ll_scores and
              max(range(len(pd_scores[d])), key=pd_scores[d].__getitem__) !=
              max(range(len(ll_scores[d])), key=ll_scores[d].__getitem__)]
    gaps = sorted(abs(a - b) for d in pd_scores if d in ll_scores
                  for a, b in zip(pd_scores[d], ll_scores[d]))
    worst = gaps[-1]
    summary = {"pdserve_acc": pd_acc, "llama_cpp_acc": ll_acc,
               "points_apart": round(abs(pd_acc - ll_acc) * 100, 3),
               "questions": len(pd_scores), "answers_differ": len(differ),
               "largest_loglik_difference": worst,
               "median_loglik_difference": gaps[len(gaps) // 2],
               "pdserve_weights": os.environ.get("PDSERVE_MODEL__WEIGHTS", "default"),
               "deployment": "colocated" if args.colocated else "1P1D", "results": out}
    print(json.dumps(summary))
    ok = abs(pd_acc - ll_acc) * 100 <= 1.0 and len(pd_scores) == len(ll_scores) > 0
    print(("ok  " if ok else "FAIL") + f" lm-eval {TASK}: pdserve acc {pd_acc:.4f}, llama.cpp "
          f"{ll_acc:.4f} ({summary['points_apart']} points apart; {len(differ)} of "
          f"{len(pd_scores)} answers differ; largest log-likelihood difference {worst:.4f})")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
