#!/usr/bin/env bash
# KV cache tiers (issue 30) on a multi-turn chat workload whose KV is several times a small
# block pool: one colocated `pdserve serve` instance of MODEL, started twice in one run:
#
#   benches/kv_tiers.sh [OUT_DIR]
#
#   no-tiers   prefix cache on, [kv_tiers] off: an evicted session's next turn recomputes
#   host       [kv_tiers] on, host spill region only (HOST_BYTES)
#   disk       [kv_tiers] on, no host region, a fresh disk directory (in OUT_DIR)
#   shared-a   [kv_tiers] on, only a shared store: a fresh directory (in OUT_DIR)
#   shared-b   a second instance on shared-a's store (a new process, an empty pool): the
#              same sessions again, restored from what shared-a wrote
#   redis-a/b  the same two on a Redis store (a redis-server this script starts on REDIS_PORT;
#              skipped when redis-server is not installed)
#
# Each run drives the instance with `pdserve bench serve --multi-turn-sessions` (SESSIONS
# sessions sharing a SYSTEM-token system prompt, TURN tokens per user turn, REQUESTS requests,
# concurrency CONC, OUTPUT tokens each) and reads /metrics. Reported per run: TTFT p50/p99
# (all turns, and turns 2+), prompt tokens computed (queried − served from the prefix cache)
# and blocks restored per tier. The pool is NUM_BLOCKS blocks of 16 tokens.
#
# Then the cost when nothing hits: REQUESTS all-new random prompts of RANDOM_LEN tokens
# (every evicted block is copied out, none is ever restored), without and with the host tier
# (`new-no-tiers`, `new-host`). NEW_ONLY=1 runs only those two, ROUNDS times alternated
# (default 1), and reports the spill time the host tier added on the ranks' step path.
#
# STREAM_AB=1 runs only the multi-turn workload on the disk tier, ROUNDS times alternated:
# `disk-whole` (kv_tiers.stream_layers = false: load every block, then compute) and
# `disk-stream` (the default: compute while the layers land), each on a fresh directory,
# and reports the layers computed before their restore's last layer landed. DROP_CACHES=1
# syncs and drops the page cache every DROP_EVERY seconds (default 0.2) during those runs, so the
# tier's reads come from the disk rather than from memory; READ_BPS (bytes/s) puts each
# `pdserve serve` in a cgroup-v1 blkio group reading the disk under OUT_DIR at that rate
# (a slower disk or a network store; both need root).
set -euo pipefail
cd "$(dirname "$0")/.."

out=${1:-$(mktemp -d)}
mkdir -p "$out"
[ -n "${NO_BUILD:-}" ] || cargo build --release --quiet -p pdserve --bin pdserve
bin=target/release/pdserve
model=${MODEL:-default}
sessions=${SESSIONS:-8}
requests=${REQUESTS:-32}
system=${SYSTEM:-256}
turn=${TURN:-64}
conc=${CONC:-1}
output=${OUTPUT:-8}
blocks=${NUM_BLOCKS:-64}
host_bytes=${HOST_BYTES:-1073741824}
port=${PORT:-18431}
random_len=${RANDOM_LEN:-512}
multi_turn=(--endpoint chat --multi-turn-sessions "$sessions" --system-prompt-len "$system" --turn-len "$turn")

run() {
    local name=$1 workload=$2
    shift 2
    local url="http://127.0.0.1:$port"
    env "$@" PDSERVE_SCHEDULER__NUM_BLOCKS="$blocks" \
        "$bin" serve --model "$model" --port "$port" >"$out/$name.serve.log" 2>&1 &
    local pid=$!
    if [ -n "${READ_BPS:-}" ]; then
        echo "$pid" >"$slow_cgroup/cgroup.procs"
    fi
    for _ in $(seq 1 600); do
        curl -sf "$url/health" >/dev/null 2>&1 && break
        sleep 0.5
    done
    curl -sf "$url/health" >/dev/null || { echo "$name did not start; see $out/$name.serve.log" >&2; kill "$pid"; exit 1; }
    local args=("${multi_turn[@]}")
    [ "$workload" = new ] && args=(--endpoint completions --input-len "$random_len")
    "$bin" bench serve --url "$url" "${args[@]}" --num-requests "$requests" \
        --output-len "$output" --concurrency "$conc" --json >"$out/$name.bench.json"
    curl -sf "$url/metrics" >"$out/$name.metrics"
    kill -TERM "$pid"
    wait "$pid" || true
}

redis_runs=()
if [ -n "${READ_BPS:-}" ]; then
    slow_cgroup=/sys/fs/cgroup/blkio/pdserve-kv-tiers-bench
    mkdir -p "$slow_cgroup"
    trap 'rmdir "$slow_cgroup" 2>/dev/null || true' EXIT
    disk=$(findmnt -no SOURCE --target "$out" | sed 's/\[.*//')
    echo "$(lsblk -ndo MAJ:MIN "$disk" | tr -d ' ') $READ_BPS" \
        >"$slow_cgroup/blkio.throttle.read_bps_device"
fi
if [ -n "${STREAM_AB:-}" ]; then
    dropper=""
    if [ -n "${DROP_CACHES:-}" ]; then
        (while :; do sync; echo 1 >/proc/sys/vm/drop_caches; sleep "${DROP_EVERY:-0.2}"; done) &
        dropper=$!
    fi
    for round in $(seq 1 "${ROUNDS:-1}"); do
        for mode in whole stream; do
            stream=false
            [ "$mode" = stream ] && stream=true
            rm -rf "$out/disk-tier"
            run "disk-$mode-$round" turns PDSERVE_KV_TIERS__ENABLED=true \
                PDSERVE_KV_TIERS__HOST_CAPACITY_BYTES=0 PDSERVE_KV_TIERS__DISK_DIR="$out/disk-tier" \
                PDSERVE_KV_TIERS__STREAM_LAYERS="$stream"
        done
    done
    [ -z "$dropper" ] || kill "$dropper"
elif [ -z "${NEW_ONLY:-}" ]; then
run no-tiers turns PDSERVE_KV_TIERS__ENABLED=false
run host turns PDSERVE_KV_TIERS__ENABLED=true PDSERVE_KV_TIERS__HOST_CAPACITY_BYTES="$host_bytes"
rm -rf "$out/disk-tier"
run disk turns PDSERVE_KV_TIERS__ENABLED=true PDSERVE_KV_TIERS__HOST_CAPACITY_BYTES=0 \
    PDSERVE_KV_TIERS__DISK_DIR="$out/disk-tier"
rm -rf "$out/shared-store"
for who in a b; do
    run "shared-$who" turns PDSERVE_KV_TIERS__ENABLED=true PDSERVE_KV_TIERS__HOST_CAPACITY_BYTES=0 \
        PDSERVE_KV_TIERS__SHARED_DIR="$out/shared-store"
done
if command -v redis-server >/dev/null; then
    redis_port=${REDIS_PORT:-18432}
    redis-server --bind 127.0.0.1 --port "$redis_port" --save "" --appendonly no \
        >"$out/redis.log" 2>&1 &
    redis_pid=$!
    sleep 1
    for who in a b; do
        run "redis-$who" turns PDSERVE_KV_TIERS__ENABLED=true \
            PDSERVE_KV_TIERS__HOST_CAPACITY_BYTES=0 \
            PDSERVE_KV_TIERS__SHARED_URL="redis://127.0.0.1:$redis_port/0"
    done
    kill "$redis_pid"
    redis_runs=(redis-a redis-b)
else
    echo "redis-server not installed: no Redis runs" >&2
fi
fi
for round in $(seq 1 "${ROUNDS:-1}"); do
    [ -z "${STREAM_AB:-}" ] || break
    suffix=""
    [ "$round" = 1 ] || suffix="-$round"
    run "new-no-tiers$suffix" new PDSERVE_KV_TIERS__ENABLED=false
    run "new-host$suffix" new PDSERVE_KV_TIERS__ENABLED=true \
        PDSERVE_KV_TIERS__HOST_CAPACITY_BYTES="$host_bytes"
done

python3 - "$out" "${redis_runs[@]}" <<'EOF'
import json, sys
out = sys.argv[1]
HOST, DISK, SHARED = 'tier="host"', 'tier="disk"', 'tier="shared"'
def metric(lines, name, label=None):
    total = 0.0
    for line in lines:
        if line.startswith(name) and (label is None or label in line):
            rest = line[len(name):]
            if rest[:1] in ("{", " "):
                total += float(line.rsplit(" ", 1)[1])
    return total
print(f"{'config':<12} {'TTFT p50':>9} {'TTFT p99':>9} {'turn2+ p50':>10} {'turn2+ p99':>10} "
      f"{'computed':>9} {'cached':>7} {'host hits':>9} {'disk hits':>9} {'shared hits':>11} "
      f"{'misses':>6}")
import os
def runs(prefix):
    return sorted(n[:-len(".bench.json")] for n in os.listdir(out)
                  if n.startswith(prefix) and n.endswith(".bench.json"))
news = runs("new-")
ab = runs("disk-whole-") + runs("disk-stream-")
for name in ["no-tiers", "host", "disk", "shared-a", "shared-b", *sys.argv[2:], *news, *ab]:
    if not os.path.exists(f"{out}/{name}.bench.json"):
        continue
    b = json.load(open(f"{out}/{name}.bench.json"))
    m = open(f"{out}/{name}.metrics").read().splitlines()
    query = metric(m, "pdserve_prefix_cache_query_tokens_total")
    hit = metric(m, "pdserve_prefix_cache_hit_tokens_total")
    later = b.get("ttft_ms_later_turns") or {}
    print(f"{name:<12} {b['ttft_ms']['p50']:>7.0f}ms {b['ttft_ms']['p99']:>7.0f}ms "
          f"{later.get('p50', 0):>8.0f}ms {later.get('p99', 0):>8.0f}ms "
          f"{query - hit:>9.0f} {hit:>7.0f} "
          f"{metric(m, 'pdserve_kv_tier_hits_total', HOST):>9.0f} "
          f"{metric(m, 'pdserve_kv_tier_hits_total', DISK):>9.0f} "
          f"{metric(m, 'pdserve_kv_tier_hits_total', SHARED):>11.0f} "
          f"{metric(m, 'pdserve_kv_tier_misses_total'):>6.0f}")
# The tiers' cost when nothing hits, accounted rather than timed: every spill batch (copy out,
# checksum, host store) runs on the rank's thread ahead of a step, so its summed time is what
# the tiers added to the requests' time to first token (at concurrency 1, all of it is).
for name in (n for n in news if n.startswith("new-host")):
    b = json.load(open(f"{out}/{name}.bench.json"))
    m = open(f"{out}/{name}.metrics").read().splitlines()
    spill = metric(m, "pdserve_kv_tier_spill_seconds_sum")
    batches = metric(m, "pdserve_kv_tier_spill_seconds_count")
    ttft_sum = b["ttft_ms"]["mean"] * b["completed"] / 1000
    print(f"{name}: {batches:.0f} spill batches took {spill * 1000:.0f} ms on the rank thread, "
          f"{100 * spill / ttft_sum:.1f} % of the requests' summed TTFT ({ttft_sum:.1f} s)")
# Layer-by-layer load-back: how much of each restore's load the compute overlapped.
for name in ab:
    m = open(f"{out}/{name}.metrics").read().splitlines()
    loads = metric(m, "pdserve_kv_tier_load_seconds_count")
    load_ms = 1000 * metric(m, "pdserve_kv_tier_load_seconds_sum") / max(loads, 1)
    early = metric(m, "pdserve_kv_tier_stream_early_layers_total")
    print(f"{name}: {loads:.0f} restores, load-back {load_ms:.1f} ms mean, "
          f"{early:.0f} layers computed before their restore's last layer landed")
print(f"(JSON and /metrics of every run in {out})")
EOF
