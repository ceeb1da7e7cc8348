#!/usr/bin/env bash
# Prefix caching and KV-aware routing on a multi-turn chat workload, three configurations of
# `pdserve launch --prefill 1 --decode 2` in one run:
#
#   benches/multi_turn.sh [OUT_DIR]
#
#   no-cache     --no-prefix-cache (every turn computes and moves its whole prompt)
#   cache-rr     prefix cache on, --router round-robin
#   cache-kv     prefix cache on, --router kv (the default)
#
# Each run starts a fresh cluster of MODEL (default: the default model), drives it with
# `pdserve bench serve --multi-turn-sessions` (SESSIONS sessions sharing a SYSTEM-token system
# prompt, TURN tokens per user turn, REQUESTS requests = REQUESTS/SESSIONS turns each,
# concurrency CONC), then reads every instance's figures with `pdserve inspect --json`.
# Reported per run: TTFT p50/p99 (all turns, and turns 2+), prompt tokens the prefill
# instance computed, KV bytes moved per request (decode side), prefix hit rate of the prefill
# and of the decode instances, and the router's decisions. JSON of every run lands in OUT_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."

out=${1:-$(mktemp -d)}
mkdir -p "$out"
cargo build --release --quiet
bin=target/release/pdserve
model=${MODEL:-default}
sessions=${SESSIONS:-8}
requests=${REQUESTS:-32}
system=${SYSTEM:-1024}
turn=${TURN:-64}
conc=${CONC:-4}
output=${OUTPUT:-16}
threads=${THREADS:-1}

run() {
    local name=$1
    shift
    local log="$out/$name.launch.log"
    "$bin" launch --model "$model" --prefill 1 --decode 2 --port 0 --threads "$threads" "$@" \
        >"$out/$name.launch.out" 2>"$log" &
    local pid=$!
    local url="" inspect=""
    for _ in $(seq 1 600); do
        if [ "$(wc -l <"$out/$name.launch.out")" -ge 2 ]; then
            url=$(sed -n 1p "$out/$name.launch.out")
            inspect=$(sed -n 2p "$out/$name.launch.out")
            break
        fi
        sleep 0.5
    done
    [ -n "$url" ] || { echo "launch of $name printed no URL; see $log" >&2; kill "$pid"; exit 1; }
    # `  inspect: pdserve inspect ADDR --credentials-dir DIR`
    local addr dir
    addr=$(echo "$inspect" | awk '{print $4}')
    dir=$(echo "$inspect" | awk '{print $6}')
    for _ in $(seq 1 600); do
        curl -sf "$url/health" >/dev/null 2>&1 && break
        sleep 0.5
    done
    "$bin" bench serve --url "$url" --endpoint chat --multi-turn-sessions "$sessions" \
        --num-requests "$requests" --system-prompt-len "$system" --turn-len "$turn" \
        --output-len "$output" --concurrency "$conc" --json >"$out/$name.bench.json"
    "$bin" inspect "$addr" --credentials-dir "$dir" --json >"$out/$name.inspect.json"
    curl -sf "$url/metrics" >"$out/$name.proxy.metrics" || true
    kill -TERM "$pid"
    wait "$pid" || true
}

run no-cache --no-prefix-cache --router round-robin
run cache-rr --router round-robin
run cache-kv --router kv

python3 - "$out" "$requests" "$sessions" <<'EOF'
import json, sys
out, requests, sessions = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
print(f"{'config':<10} {'TTFT p50':>9} {'TTFT p99':>9} {'turn2+ p50':>10} {'prefill computed':>16} "
      f"{'KV/request':>11} {'prefill hit':>11} {'decode hit':>10}  router decisions")
for name in ["no-cache", "cache-rr", "cache-kv"]:
    b = json.load(open(f"{out}/{name}.bench.json"))
    snap = json.load(open(f"{out}/{name}.inspect.json"))
    inst = [m["snapshot"] for m in snap["instances"] if "snapshot" in m]
    pre = [s for s in inst if s["role"] == "prefill"]
    dec = [s for s in inst if s["role"] == "decode"]
    def hit(ss):
        p = sum(s["prompt_tokens"] for s in ss)
        return 100.0 * sum(s["prompt_tokens_cached"] for s in ss) / p if p else 0.0
    computed = sum(s["prompt_tokens"] - s["prompt_tokens_cached"] for s in pre)
    kv = sum(s["handoff_bytes"] for s in dec) / max(1, b.get("completed", requests))
    ttft = b["ttft_ms"]
    later = b.get("ttft_ms_later_turns") or {}
    decisions = []
    try:
        for line in open(f"{out}/{name}.proxy.metrics"):
            if line.startswith("pdserve_router_decisions_total{"):
                labels, v = line.rsplit(" ", 1)
                decisions.append(f"{labels[len('pdserve_router_decisions_total'):]}={float(v):.0f}")
    except FileNotFoundError:
        pass
    print(f"{name:<10} {ttft['p50']:>7.0f}ms {ttft['p99']:>7.0f}ms "
          f"{(str(round(later['p50'])) + 'ms') if later else 'n/a':>10} {computed:>16} "
          f"{kv / 1e6:>9.2f}MB {hit(pre):>10.1f}% {hit(dec):>9.1f}%  {' '.join(decisions)}")
print(f"(JSON in {out})")
EOF
