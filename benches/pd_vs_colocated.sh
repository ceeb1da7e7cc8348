#!/usr/bin/env bash
# 1P1D against one colocated instance on the same two cores, with `pdserve bench serve`.
#
#   benches/pd_vs_colocated.sh [OUT_DIR]
#
# Workload (mixed, Poisson arrivals): 3 of 4 requests are chat-like (short prompt, long answer),
# 1 of 4 is a long document (long prompt, short answer) arriving while the others decode.
# Runs, each on a freshly started cluster of the default model:
#   colocated   one `pdserve serve`, 2 threads, pinned to cores 0-1
#   pd-pull     prefill pinned to core 0, decode pinned to core 1 (1 thread each), shm, pull
#   pd-push     the same with layerwise push
#   pd-push-cd  pd-push with conditional disaggregation: prompts under 256 tokens are
#               prefilled on the decode instance (--min-remote-prompt-tokens 256)
# then the layerwise-push against transfer-after-prefill comparison: long prompts alone,
# one at a time, TTFT only, over shm and tcp.
# Every run's JSON report lands in OUT_DIR (default: a temp dir); a summary table is printed.
# Needs an idle machine: candle's compute threads spin, so any other load distorts the figures.
set -euo pipefail
cd "$(dirname "$0")/.."

out=${1:-$(mktemp -d)}
mkdir -p "$out"
cargo build --release --quiet
bin=target/release/pdserve
model=$($bin model pull)
rate=${RATE:-0.8}
requests=${REQUESTS:-48}

# The dataset: prompts of common words (about one token each).
python3 - "$out/mixed.jsonl" <<'EOF'
import json, random, sys
random.seed(7)
words = "the of and to in is for that with on as it by at from this be are was or an have not but can all one time new we more will about out up so what there people year work day way world life house water food city book school family music light small great good long place hand number story river tree".split()
with open(sys.argv[1], "w") as f:
    for i in range(64):
        if i % 4 == 3:
            n, out = 1000, 16
        else:
            n, out = 48, 128
        prompt = " ".join(random.choice(words) for _ in range(n))
        f.write(json.dumps({"prompt": prompt, "output_len": out}) + "\n")
EOF
python3 - "$out/long.jsonl" <<'EOF'
import json, random, sys
random.seed(11)
words = "the of and to in is for that with on as it by at from this be are was or an have not but can all one time new we more will about out up so what there people year work day way world life house water food city book school family music light small great good long place hand number story river tree".split()
with open(sys.argv[1], "w") as f:
    for i in range(8):
        f.write(json.dumps({"prompt": " ".join(random.choice(words) for _ in range(1000)), "output_len": 2}) + "\n")
EOF

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
pids=()
stop() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; pids=(); }
trap stop EXIT
wait_health() {
    for _ in $(seq 600); do
        curl -sf "$1/health" >/dev/null 2>&1 && return 0
        sleep 0.2
    done
    echo "$1 never became healthy" >&2
    return 1
}
export PDSERVE_LOGGING__FILTER=warn

colocated() { # sets $url
    local port; port=$(free_port)
    taskset -c 0,1 $bin serve --port "$port" --threads 2 >"$out/colocated.log" 2>&1 & pids+=($!)
    url="http://127.0.0.1:$port"
    wait_health "$url"
}

pd() { # mode transport [min_remote_prompt_tokens]; sets $url and $prefill
    local pp dp xp log="$out/pd-$1-$2.log"; pp=$(free_port); dp=$(free_port); xp=$(free_port)
    taskset -c 0 $bin serve --role prefill --name bench-p --port "$pp" --threads 1 --transfer "$2" >>"$log" 2>&1 & pids+=($!)
    taskset -c 1 $bin serve --role decode --name bench-d --port "$dp" --threads 1 --transfer "$2" --transfer-mode "$1" \
        --min-remote-prompt-tokens "${3:-0}" >>"$log" 2>&1 & pids+=($!)
    prefill="http://127.0.0.1:$pp"; decode="http://127.0.0.1:$dp"
    wait_health "http://127.0.0.1:$pp"
    wait_health "http://127.0.0.1:$dp"
    $bin proxy --port "$xp" --prefill "http://127.0.0.1:$pp" --decode "http://127.0.0.1:$dp" >>"$log" 2>&1 & pids+=($!)
    url="http://127.0.0.1:$xp"
    wait_health "$url"
}

mixed() { # name url
    $bin bench serve --url "$2" --dataset "$out/mixed.jsonl" --request-rate "$rate" \
        --num-requests "$requests" --seed 1 --json > "$out/$1.json"
    stop
}

long_alone() { # name url
    $bin bench serve --url "$2" --dataset "$out/long.jsonl" --concurrency 1 \
        --num-requests 8 --json > "$out/$1.json"
    # Where the time went: the prefill instance's own time to T0 (its forward pass), and the
    # decode side's hand-off (remote prefill + transfer) — sums and counts of the histograms.
    curl -s "$prefill/metrics" | grep -E '^pdserve_time_to_first_token_seconds_(sum|count)' > "$out/$1.prefill.prom"
    curl -s "$decode/metrics" | grep -E '^pdserve_kv_transfer_seconds_(sum|count)' > "$out/$1.decode.prom"
    stop
}

url=; prefill=; decode=
colocated; mixed colocated "$url"
pd pull shm; mixed pd-pull "$url"
pd push shm; mixed pd-push "$url"
pd push shm 256; mixed pd-push-cd "$url"
for t in shm tcp; do
    pd pull $t; long_alone "long-pull-$t" "$url"
    pd push $t; long_alone "long-push-$t" "$url"
done

python3 - "$out" <<'EOF'
import json, sys, os
out = sys.argv[1]
def load(n): return json.load(open(os.path.join(out, n + ".json")))
def ms(r, metric, p): return r[metric][p]
print(f"mixed workload ({out})")
print("| setup | ok/failed | output tok/s | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) |")
print("|---|---|---|---|---|")
for n in ["colocated", "pd-pull", "pd-push", "pd-push-cd"]:
    r = load(n)
    print(f"| {n} | {r['completed']}/{r['failed']} | {r['output_throughput']:.1f} | "
          f"{ms(r,'ttft_ms','p50'):.0f} / {ms(r,'ttft_ms','p99'):.0f} | "
          f"{ms(r,'tpot_ms','p50'):.1f} / {ms(r,'tpot_ms','p99'):.1f} |")
print()
print("long prompts alone (~1000 tokens), TTFT")
def mean(path, name):
    # Sums over every label set (the unlabelled empty series included).
    tot = {"_sum": 0.0, "_count": 0.0}
    for line in open(os.path.join(out, path)):
        k, x = line.split()
        for suffix in tot:
            if k.split("{")[0] == name + suffix:
                tot[suffix] += float(x)
    return 1e3 * tot["_sum"] / max(tot["_count"], 1)
print("| transport | mode | client TTFT p50 / p99 (ms) | prefill forward pass, mean (ms) | decode: remote prefill + hand-off, mean (ms) | hand-off after the forward pass (ms) |")
print("|---|---|---|---|---|---|")
for t in ["shm", "tcp"]:
    for mode in ["pull", "push"]:
        n = f"long-{mode}-{t}"
        r = load(n)
        fwd = mean(n + ".prefill.prom", "pdserve_time_to_first_token_seconds")
        hand = mean(n + ".decode.prom", "pdserve_kv_transfer_seconds")
        print(f"| {t} | {mode} | {ms(r,'ttft_ms','p50'):.0f} / {ms(r,'ttft_ms','p99'):.0f} | "
              f"{fwd:.0f} | {hand:.0f} | {hand - fwd:.0f} |")
EOF
