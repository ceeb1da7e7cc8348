#!/usr/bin/env bash
# The device check of issue 31 (docs/cuda.md, "Verifying on a GPU"): one call on a lent GPU
# machine, from a binary built elsewhere with `--features cuda` and carried.
#
#   benches/device_check.sh [PDSERVE_BINARY] [OUT_DIR]
#
# Default binary .gpu/pdserve, default OUT_DIR $OUT (else ./device-check-out). Environment:
#   DEVICE_CHECK_STEPS     steps to run, space-separated (default: all, in this order)
#                          verify bench transfer verify16 serve launch vision kv16 hf busy
#   DEVICE_CHECK_BASELINE  an older binary: `bench` then alternates it with this one (two
#                          rounds of `bench model` each), a before/after on the same machine
#   DEVICE_CHECK_BUDGET_S  wall-clock budget in seconds (default 420): a step that would start
#                          with under 20 s left is skipped and marked so; each step also has
#                          its own timeout.
#
# Writes to OUT_DIR (at most 8 files come back from a lent machine, so it keeps to four):
#   summary.json   one object: every step's status, exit code and seconds, and the figures
#                  (greedy agreement GPU vs CPU with margins at a divergence, P/D hand-offs,
#                  tokens/s, GB/s beside cuMemcpy, serve/launch answers, quic/tcp ratios)
#   log.txt        everything the steps printed
#   results.tgz    each step's raw output (verify JSON, bench tables, server logs)
#   env.txt        GPU, driver, libraries found
#
# Steps:
#   verify    `cuda verify --dtype f32 --cpu-weights f32 --bench`: greedy tokens, 4 prompts x 32,
#             GPU vs CPU on the same f32 weights, first divergence with logit margins; P/D
#             hand-offs GPU prefill -> host mirror -> CPU decode and -> second GPU group;
#             prefill/decode tokens/s at batch 1 and 32; KV GB/s beside cuMemcpy; the attention
#             kernel's whole and split launches compared bit for bit
#   bench     `bench model --device cuda --dtype f16` on the same synthetic GGUF
#   transfer  `bench transfer --backend tcp --backend quic --io-threads N` for N = 2, 4, 8,
#             and reads at 8 (the machine's 16 cores; quic's target is >= 0.8x plain tcp)
#   verify16  `cuda verify --dtype f16 --cpu-weights auto`: GPU f16 vs the CPU default
#   serve     `serve --device cuda` answering a greedy chat completion, compared with
#             `serve` on the CPU (f32 weights both)
#   launch    `launch --device cuda` 1P1D (prefill and decode on the one GPU) against a
#             colocated `serve --device cuda`: greedy tokens identical, over CUDA IPC (what
#             one GPU negotiates) and over the host path (host proofs made unusable), with
#             the KV path each negotiated and the hand-off gap of a ~1500-token prompt
#   hf        pdserve (`cuda verify --model HF_EXPORT --dtype f16 --bench`) and HF transformers
#             (f16, KV cache on) on the HF export of the synthetic model's unquantized weights:
#             greedy tokens compared, tokens/s beside each other (benches/cuda_hf_reference.py)
#   vision    image chats (one image, two images) on the seeded synthetic VLM
#             (`synthetic:tiny,vision=1`), f32 weights everywhere: `serve` on the CPU,
#             `serve --device cuda` (the image rows replace their placeholder tokens on the
#             GPU), and E/P/D under `launch --device cuda --encode 1` (encoder, prefill and
#             decode on the one GPU); token ids compared
#   kv16      f16 KV on the GPU: `cuda verify --dtype f32 --cpu-weights f32 --kv-dtype f16`
#             (GPU vs CPU, both with f16 KV; P/D hand-offs by KV bytes); `bench model --device
#             cuda --dtype f16` with f16 and f32 KV alternated, two rounds (decode at 512-8192
#             tokens of context); `serve --device cuda --kv-cache-dtype f16` and 1P1D `launch
#             --device cuda` with f16 KV (CUDA IPC and host path): tokens compared, hand-off gap
#   busy      served decode beside neighbours: `serve --device cuda` and `serve` on the CPU,
#             each driven by `bench serve` (~512-token prompts, 128 tokens out, one at a time)
#             idle, beside one `nice -n 19` busy loop and beside one per core: end-to-end time
#             per request (the synthetic model's tokens carry no text to time chunk by chunk)
#
# The model is a seeded synthetic model of SmolLM2-135M's shape written as a Q4_1 GGUF (the
# real 93 MB GGUF does not fit what can be carried to a GPU machine).
set -uo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
bin="$(realpath "${1:-.gpu/pdserve}")"
out="$(mkdir -p "${2:-${OUT:-device-check-out}}" && realpath "${2:-${OUT:-device-check-out}}")"
steps="${DEVICE_CHECK_STEPS:-verify bench transfer verify16 serve launch vision kv16 hf busy}"
budget="${DEVICE_CHECK_BUDGET_S:-420}"
start=$(date +%s)
work="$(mktemp -d)"
raw="$work/raw"
mkdir -p "$raw"
export PDSERVE_HOME="$work/home"
export PYTHONUNBUFFERED=1
exec > >(tee -a "$out/log.txt") 2>&1

# Kernels: PTX precompiled elsewhere (`pdserve cuda compile --out .gpu/cuda-kernels`) needs no
# NVRTC here; NVRTC of the CUDA toolkit or the Python install's wheels compiles what is missing.
if [ -d .gpu/cuda-kernels ]; then
    export PDSERVE_CUDA_KERNELS="$root/.gpu/cuda-kernels"
fi
libdirs=(/usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib)
while IFS= read -r d; do libdirs+=("$d"); done < <(python3 - <<'PY' 2>/dev/null || true
import glob, os, site
for base in site.getsitepackages():
    for d in glob.glob(os.path.join(base, "nvidia", "*", "lib")):
        print(d)
PY
)
if [ -z "${PDSERVE_NVRTC_LIB:-}" ]; then
    for d in "${libdirs[@]}"; do
        for n in libnvrtc.so.13 libnvrtc.so.12; do
            if [ -f "$d/$n" ]; then export PDSERVE_NVRTC_LIB="$d/$n"; break 2; fi
        done
    done
fi
# cuBLAS is loaded by cudarc by its soname: make its directory findable.
for d in "${libdirs[@]}"; do
    if ls "$d"/libcublas.so* >/dev/null 2>&1; then
        export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
    fi
done
{
    echo "binary: $bin"
    echo "NVRTC: ${PDSERVE_NVRTC_LIB:-none}; PTX cache: ${PDSERVE_CUDA_KERNELS:-none}"
    echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv || true
    nproc
} >"$out/env.txt" 2>&1
cat "$out/env.txt"
"$bin" cuda probe --json >"$raw/probe.json"
cat "$raw/probe.json"

status="$work/status.jsonl"
: >"$status"
# run_step NAME TIMEOUT_S COMMAND...: runs unless the budget is spent, records status.
run_step() {
    local name="$1" limit="$2"
    shift 2
    case " $steps " in *" $name "*) ;; *) return 0 ;; esac
    local now left rc t0
    now=$(date +%s)
    left=$((budget - (now - start)))
    if [ "$left" -lt 20 ]; then
        echo "{\"step\":\"$name\",\"status\":\"skipped\",\"why\":\"budget spent\"}" >>"$status"
        echo "== $name: skipped (budget spent)"
        return 0
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "== $name (timeout ${limit}s)"
    t0=$(date +%s)
    timeout --kill-after=5 "$limit" bash -c '"$@"' _ "$@"
    rc=$?
    local st=ok
    [ "$rc" -ne 0 ] && st=failed
    [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && st=timeout
    echo "{\"step\":\"$name\",\"status\":\"$st\",\"rc\":$rc,\"seconds\":$(($(date +%s) - t0))}" >>"$status"
    echo "== $name: $st (rc $rc, $(($(date +%s) - t0)) s)"
}

# The model of serve, launch and bench (DEVICE_CHECK_MODEL overrides it, e.g. to try the
# script's plumbing with `synthetic:tiny` on a machine without a GPU).
gguf="${DEVICE_CHECK_MODEL:-$PDSERVE_HOME/cuda-verify/synthetic-smollm.Q4_1.gguf}"
ensure_model() {
    [ -n "${DEVICE_CHECK_MODEL:-}" ] || [ -f "$gguf" ] || "$bin" cuda verify --tokens 1 --json >/dev/null
}

step_verify() {
    "$bin" cuda verify --dtype f32 --cpu-weights f32 --tokens 32 --bench --json \
        --export-hf "$work/hf-model" >"$raw/verify-f32.json"
}
step_bench() {
    ensure_model || return 1
    "$bin" bench model --device cuda --dtype f16 --model "$gguf" | tee "$raw/bench-model.txt" ||
        return 1
    # Before/after on the same machine: DEVICE_CHECK_BASELINE names an older binary (carried
    # beside this one); the two alternate, two rounds each.
    local base="${DEVICE_CHECK_BASELINE:-}" round
    [ -n "$base" ] || return 0
    for round in 1 2; do
        "$base" bench model --device cuda --dtype f16 --model "$gguf" \
            >"$raw/bench-model-baseline-$round.txt" || return 1
        "$bin" bench model --device cuda --dtype f16 --model "$gguf" --prompts "" \
            >"$raw/bench-model-$round.txt" || return 1
    done
    tail -n 8 "$raw"/bench-model-*.txt
}
step_transfer() {
    for n in 2 4 8; do
        "$bin" bench transfer --backend tcp --backend quic --tcp-integrity none \
            --io-threads "$n" --json >"$raw/transfer-io$n.json" || return 1
    done
    # Reads: pull mode's direction (decode reads what prefill holds).
    "$bin" bench transfer --backend tcp --backend quic --tcp-integrity none --reads \
        --io-threads 8 --json >"$raw/transfer-io8r.json"
}
step_verify16() {
    "$bin" cuda verify --dtype f16 --cpu-weights auto --tokens 32 --json >"$raw/verify-f16.json"
}
step_hf() {
    # The HF export holds the synthetic model's unquantized weights (the GGUF is Q4_1), so
    # pdserve runs on the export itself (f16, as HF does) and HF is compared with that.
    [ -d "$work/hf-model" ] || return 1
    "$bin" cuda verify --model "$work/hf-model" --dtype f16 --cpu-weights f32 --tokens 32 \
        --bench --json >"$raw/verify-hf.json" || return 1
    python3 benches/cuda_hf_reference.py "$work/hf-model" "$raw/verify-hf.json" >"$raw/hf.json"
}
# wait_health URL LIMIT_S PID: waits for /health while PID lives, at most LIMIT_S seconds.
wait_health() {
    local url="$1" limit="$2" pid="$3" i
    for ((i = 0; i < limit * 5; i++)); do
        curl -sf "$url/health" >/dev/null 2>&1 && return 0
        kill -0 "$pid" 2>/dev/null || return 1
        sleep 0.2
    done
    return 1
}
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
# chat BASE_URL OUTFILE: one greedy chat completion, 48 tokens, ignoring EOS.
chat() {
    curl -sS --max-time 60 "$1/v1/chat/completions" -H 'content-type: application/json' -d '{
      "model": "m", "temperature": 0, "max_tokens": 48, "ignore_eos": true, "return_token_ids": true,
      "messages": [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]
    }' >"$2"
}
# serve_one NAME DEVICE PORT ARGS...: starts `serve` in the background, waits for health.
serve_one() {
    local name="$1" device="$2" port="$3"
    shift 3
    "$bin" serve --model "${SERVE_MODEL:-$gguf}" --served-model-name m --device "$device" \
        --host 127.0.0.1 --port "$port" "$@" >"$raw/$name.log" 2>&1 &
    echo $! >"$work/$name.pid"
    wait_health "http://127.0.0.1:$port" 90 "$(cat "$work/$name.pid")"
}
stop_one() { kill "$(cat "$work/$1.pid")" 2>/dev/null; wait "$(cat "$work/$1.pid")" 2>/dev/null; true; }

step_serve() {
    ensure_model || return 1
    local rc=0 name device
    # CPU f32 and GPU f32 (agreement, as `verify` measures it); GPU f16, the default dtype
    # (what `launch` is compared with).
    for spec in "serve-cpu cpu --weights f32" "serve-cuda-f32 cuda --dtype f32" "serve-cuda cuda"; do
        set -- $spec
        name=$1 device=$2
        shift 2
        local port
        port=$(free_port)
        if serve_one "$name" "$device" "$port" "$@"; then
            chat "http://127.0.0.1:$port" "$raw/$name.json" || rc=1
        else
            rc=1
            tail -5 "$raw/$name.log"
        fi
        stop_one "$name"
    done
    return $rc
}
# stop_launch PID: Ctrl-C (a drain), at most 10 s, then kill.
stop_launch() {
    kill -INT "$1" 2>/dev/null
    for _ in $(seq 1 50); do kill -0 "$1" 2>/dev/null || break; sleep 0.2; done
    kill -9 "$1" 2>/dev/null
    wait "$1" 2>/dev/null
}
# launch_one NAME [ENV=VALUE...]: 1P1D `launch --device cuda`, one short greedy chat (compared
# with colocated) and one long prompt (~1500 tokens: the hand-off's timing in the logs).
launch_one() {
    local name="$1" port rc=0
    shift
    port=$(free_port)
    env "$@" "$bin" launch --model "$gguf" --served-model-name m --device cuda \
        --prefill 1 --decode 1 --port "$port" >"$raw/$name.log" 2>&1 &
    local pid=$!
    if wait_health "http://127.0.0.1:$port" 120 "$pid"; then
        chat "http://127.0.0.1:$port" "$raw/$name.json" || rc=1
        python3 - "http://127.0.0.1:$port" "$raw/$name-long.json" <<'PY' || rc=1
import json, sys, urllib.request
text = " ".join(["The lighthouse keeper climbed the stairs at dusk."] * 150)
body = {"model": "m", "temperature": 0, "max_tokens": 8, "ignore_eos": True,
        "return_token_ids": True, "messages": [{"role": "user", "content": text}]}
req = urllib.request.Request(sys.argv[1] + "/v1/chat/completions", json.dumps(body).encode(),
                             {"content-type": "application/json"})
open(sys.argv[2], "w").write(urllib.request.urlopen(req, timeout=60).read().decode())
PY
    else
        rc=1
        tail -20 "$raw/$name.log"
    fi
    stop_launch "$pid"
    return $rc
}
step_launch() {
    ensure_model || return 1
    local rc=0
    # On one GPU the instances negotiate CUDA IPC; with no usable host-proof directory they
    # cannot prove they share the host and keep the host path (mirror, shm, upload).
    launch_one launch || rc=1
    launch_one launch-host PDSERVE_HOST_PROOF_DIR=/proc/pdserve-no-proofs || rc=1
    return $rc
}

# vision_chats BASE_URL OUTFILE: two greedy image chats (one image; two images), 24 tokens
# each; writes the two answers' token ids as a JSON list.
vision_chats() {
    python3 - "$1" "$2" <<'PY'
import base64, json, struct, sys, urllib.request, zlib
def png(w, h, seed):
    rows = b"".join(b"\0" + bytes(((x * (7 + seed)) ^ (y * (13 + 3 * seed))) & 255
                                    for x in range(w) for _ in range(3)) for y in range(h))
    chunk = lambda t, d: struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))
def part(w, h, seed):
    url = "data:image/png;base64," + base64.b64encode(png(w, h, seed)).decode()
    return {"type": "image_url", "image_url": {"url": url}}
out = []
for images in ([part(40, 30, 1)], [part(32, 32, 2), part(24, 20, 3)]):
    content = images + [{"type": "text", "text": "Describe the images."}]
    body = {"model": "m", "temperature": 0, "max_tokens": 24, "ignore_eos": True,
            "return_token_ids": True, "messages": [{"role": "user", "content": content}]}
    req = urllib.request.Request(sys.argv[1] + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    out.append(json.loads(urllib.request.urlopen(req, timeout=60).read())["choices"][0]["token_ids"])
json.dump(out, open(sys.argv[2], "w"))
PY
}
step_vision() {
    local rc=0 port name device vlm="synthetic:tiny,vision=1"
    for spec in "vision-cpu cpu --weights f32" "vision-cuda cuda --dtype f32"; do
        set -- $spec
        name=$1 device=$2
        shift 2
        port=$(free_port)
        if SERVE_MODEL="$vlm" serve_one "$name" "$device" "$port" "$@"; then
            vision_chats "http://127.0.0.1:$port" "$raw/$name.json" || rc=1
        else
            rc=1
            tail -5 "$raw/$name.log"
        fi
        stop_one "$name"
    done
    # E/P/D on the one GPU: the proxy sends each image request to the encoder, then decode
    # drives prefill, which takes the image rows from the encoder by reference.
    port=$(free_port)
    "$bin" launch --model "$vlm" --served-model-name m --device cuda --dtype f32 --encode 1 \
        --prefill 1 --decode 1 --port "$port" >"$raw/vision-epd.log" 2>&1 &
    local pid=$!
    if wait_health "http://127.0.0.1:$port" 120 "$pid"; then
        vision_chats "http://127.0.0.1:$port" "$raw/vision-epd.json" || rc=1
        # That the images took the encode hop (and were not prefilled on decode).
        curl -sf "http://127.0.0.1:$port/metrics" | grep '^pdserve_proxy_encode_total' \
            >"$raw/vision-epd-encode.txt" || rc=1
    else
        rc=1
        tail -20 "$raw/vision-epd.log"
    fi
    stop_launch "$pid"
    return $rc
}

# f16 KV on the device: agreement with the CPU's f16 KV, decode speed against f32 KV, and
# served 1P1D hand-offs of half the bytes.
step_kv16() {
    ensure_model || return 1
    local rc=0 round kv port
    "$bin" cuda verify --dtype f32 --cpu-weights f32 --kv-dtype f16 --tokens 32 --json \
        >"$raw/verify-kv16.json" || rc=1
    for round in 1 2; do
        for kv in f16 f32; do
            "$bin" bench model --device cuda --dtype f16 --model "$gguf" --kv-dtype "$kv" \
                --prompts "" >"$raw/bench-kv-$kv-$round.txt" || rc=1
        done
    done
    tail -n 6 "$raw"/bench-kv-*.txt
    port=$(free_port)
    if serve_one serve-cuda-kv16 cuda "$port" --kv-cache-dtype f16; then
        chat "http://127.0.0.1:$port" "$raw/serve-cuda-kv16.json" || rc=1
    else
        rc=1
        tail -5 "$raw/serve-cuda-kv16.log"
    fi
    stop_one serve-cuda-kv16
    launch_one launch-kv16 PDSERVE_SCHEDULER__KV_CACHE_DTYPE=f16 || rc=1
    launch_one launch-host-kv16 PDSERVE_SCHEDULER__KV_CACHE_DTYPE=f16 \
        PDSERVE_HOST_PROOF_DIR=/proc/pdserve-no-proofs || rc=1
    return $rc
}

# Served decode with neighbours on the machine (issue 28's question, asked of this machine):
# `serve --device cuda` and `serve` on the CPU (default weights and threads), each driven by
# `bench serve` (8 requests of ~512 prompt tokens and 128 output tokens, one at a time) idle,
# beside one `nice -n 19` busy loop, and beside one per core. `bench serve --input-len` counts
# words; the synthetic model's tokenizer makes ~4.5 tokens of each, so 112 words are ~512
# tokens (the summary reports the prompt tokens the server counted).
step_busy() {
    ensure_model || return 1
    local rc=0 name device port loops
    for spec in "busy-cuda cuda" "busy-cpu cpu"; do
        set -- $spec
        name=$1 device=$2
        port=$(free_port)
        if ! serve_one "$name" "$device" "$port"; then
            rc=1
            tail -5 "$raw/$name.log"
            continue
        fi
        for loops in 0 1 "$(nproc)"; do
            local pids=()
            for ((i = 0; i < loops; i++)); do
                nice -n 19 sh -c 'while :; do :; done' &
                pids+=($!)
            done
            "$bin" bench serve --url "http://127.0.0.1:$port" --model m --input-len 112 \
                --output-len 128 --num-requests 8 --concurrency 1 --timeout-s 60 --json \
                >"$raw/$name-loops$loops.json" || rc=1
            # (`wait` with no pid would wait for the server too.)
            if [ "${#pids[@]}" -gt 0 ]; then
                kill "${pids[@]}" 2>/dev/null
                wait "${pids[@]}" 2>/dev/null
            fi
        done
        stop_one "$name"
    done
    return $rc
}

export bin raw work gguf root
export -f ensure_model step_verify step_bench step_transfer step_verify16 step_hf wait_health \
    free_port chat serve_one stop_one step_serve stop_launch launch_one step_launch step_busy vision_chats \
    step_vision step_kv16
run_step verify 150 step_verify
run_step bench "$([ -n "${DEVICE_CHECK_BASELINE:-}" ] && echo 240 || echo 90)" step_bench
run_step transfer 100 step_transfer
run_step verify16 90 step_verify16
run_step serve 120 step_serve
run_step launch 120 step_launch
run_step vision 120 step_vision
run_step kv16 200 step_kv16
run_step hf 90 step_hf
run_step busy 150 step_busy

python3 - "$raw" "$status" "$out/summary.json" <<'PY'
import glob, json, os, sys
raw, status, dest = sys.argv[1:4]
def load(name):
    try:
        return json.load(open(os.path.join(raw, name)))
    except Exception as e:
        return None
s = {"steps": [json.loads(l) for l in open(status) if l.strip()]}
s["probe"] = load("probe.json")
for name in ["verify-f32", "verify-f16", "verify-hf", "verify-kv16"]:
    r = load(name + ".json")
    if r is None:
        continue
    s[name] = {
        "dtype": r.get("dtype"), "cpu_format": r.get("cpu_format"), "kv_dtype": r.get("kv_dtype"),
        "greedy": [{"prompt_tokens": len(g["prompt_ids"]), "matched": g["matched"],
                    "of": len(g["cpu"]), "divergence": g["divergence"]} for g in r["greedy"]],
        "handoff": [{"name": h["name"], "identical": h["identical"]} for h in r["handoff"]],
        "speed": r.get("speed"), "transfer": r.get("transfer"),
        "attention_launches": r.get("attention_launches"),
    }
s["hf"] = load("hf.json")
try:
    s["bench_model"] = open(os.path.join(raw, "bench-model.txt")).read()[-3000:]
except OSError:
    pass
# The before/after rounds (DEVICE_CHECK_BASELINE): each run's table, in run order.
rounds = {}
for f in sorted(glob.glob(os.path.join(raw, "bench-model-*.txt"))):
    rounds[os.path.basename(f)[:-4]] = open(f).read()[-1500:]
if rounds:
    s["bench_model_rounds"] = rounds
tr = {}
for f in sorted(glob.glob(os.path.join(raw, "transfer-io*.json"))):
    n = f.rsplit("io", 1)[1].split(".")[0]  # "8r": reads at 8 I/O threads
    rows = json.load(open(f))
    by = {}
    for row in rows:
        by.setdefault(row.get("size_bytes", row.get("size")), {})[row["backend"]] = row.get("gbps", row.get("GB/s"))
    tr[n] = {"rows": rows, "quic_over_tcp": {str(k): (v["quic"] / v["tcp"] if v.get("tcp") and v.get("quic") else None) for k, v in by.items()}}
s["transfer_io_threads"] = tr
def text(name):
    # The synthetic model's tokens mostly decode to nothing: compare token ids.
    r = load(name)
    try:
        return r["choices"][0]["token_ids"]
    except Exception:
        return None if r is None else r
for k in ["serve-cpu", "serve-cuda-f32", "serve-cuda", "launch", "launch-host", "serve-cuda-kv16",
          "launch-kv16", "launch-host-kv16"]:
    s[k] = text(k + ".json")
# Each launch's KV path (the decode instance's negotiation log) and hand-off timing: from the
# prefill's "prompt computed" to the decode's "first decode step", per transfer (one host,
# one clock), with the long prompt's length.
import re
for k in ["launch", "launch-host", "launch-kv16", "launch-host-kv16"]:
    try:
        log = open(os.path.join(raw, k + ".log"), errors="replace").read()
    except OSError:
        continue
    computed = dict(re.findall(r"prompt computed transfer=(\w+) at_us=(\d+)", log))
    first = dict(re.findall(r"first decode step transfer=(\w+) at_us=(\d+)", log))
    gaps = [(int(first[t]) - int(computed[t])) / 1000 for t in computed if t in first]
    paths = sorted(set(re.findall(r"KV path negotiated[^\n]*", log)))[:4]
    long_prompt = load(k + "-long.json")
    s[k + "_kv"] = {
        "negotiated": [re.sub(r"\x1b\[[0-9;]*m", "", p)[:300] for p in paths],
        "handoff_gap_ms": gaps,
        "long_prompt_tokens": (long_prompt or {}).get("usage", {}).get("prompt_tokens"),
    }
busy = {}
for f in sorted(glob.glob(os.path.join(raw, "busy-*-loops*.json"))):
    r = load(os.path.basename(f))
    if r:
        # The synthetic model's tokens mostly decode to no text, so there are no content
        # chunks to time (TTFT, ITL): a request's end-to-end time over its 128 tokens is the
        # per-token figure.
        busy[os.path.basename(f)[:-5]] = {
            "e2e_ms_p50": r["e2e_ms"]["p50"], "e2e_ms_p99": r["e2e_ms"]["p99"],
            "ms_per_token_p50": r["e2e_ms"]["p50"] / 128 if r["e2e_ms"]["p50"] else None,
            "prompt_tokens_mean": r["total_input_tokens"] / r["completed"] if r.get("completed") else None,
            "output_tok_s": r["output_throughput"], "failed": r["failed"]}
if busy:
    s["busy"] = busy
for k in ["vision-cpu", "vision-cuda", "vision-epd"]:
    s[k] = load(k + ".json")
try:
    s["vision_epd_proxy_encode"] = open(os.path.join(raw, "vision-epd-encode.txt")).read().split("\n")
except OSError:
    pass
if isinstance(s.get("vision-cpu"), list):
    for k in ["vision-cuda", "vision-epd"]:
        if isinstance(s.get(k), list):
            s[k.replace("-", "_") + "_equals_cpu"] = s[k] == s["vision-cpu"]
if isinstance(s.get("serve-cpu"), list) and isinstance(s.get("serve-cuda-f32"), list):
    s["serve_cuda_f32_equals_cpu_f32"] = s["serve-cpu"] == s["serve-cuda-f32"]
for k in ["launch", "launch-host"]:
    if isinstance(s.get(k), list) and isinstance(s.get("serve-cuda"), list):
        s[k.replace("-", "_") + "_1p1d_equals_colocated_cuda"] = s[k] == s["serve-cuda"]
for k in ["launch-kv16", "launch-host-kv16"]:
    if isinstance(s.get(k), list) and isinstance(s.get("serve-cuda-kv16"), list):
        s[k.replace("-", "_") + "_1p1d_equals_colocated_cuda_kv16"] = s[k] == s["serve-cuda-kv16"]
# bench model with f16 and f32 KV, alternated: the batch-1 decode-at-context lines.
kvb = {}
for f in sorted(glob.glob(os.path.join(raw, "bench-kv-*.txt"))):
    kvb[os.path.basename(f)[:-4]] = open(f).read()[-1200:]
if kvb:
    s["bench_kv"] = kvb
json.dump(s, open(dest, "w"), indent=1)
print(json.dumps({k: v for k, v in s.items() if k not in ("bench_model", "transfer_io_threads", "bench_kv", "bench_model_rounds")}, separators=(",", ":"))[:8000])
for n, t in tr.items():
    print("quic/tcp io_threads", n, t["quic_over_tcp"])
PY
# Servers of a step that ran out of time.
pkill -f "$bin (serve|launch)" 2>/dev/null
tar czf "$out/results.tgz" -C "$work" raw 2>/dev/null
echo "device check: $(($(date +%s) - start)) s"
