#!/usr/bin/env bash
# KV cache tiers (issue 30) on a P/D cluster: `pdserve launch --prefill 1 --decode 1` with
# small block pools, driven by multi-turn chat sessions whose KV is many times the pools.
#
#   benches/kv_tiers_pd.sh [OUT_DIR]
#
#   no-tiers      prefix cache on, [kv_tiers] off: a session whose blocks left a pool
#                 recomputes (prefill) and moves (decode) its whole history
#   host          [kv_tiers] on in both instances, a host spill region of HOST_BYTES each
#   disk-restart  [kv_tiers] on, no host region, each instance's disk tier in its own
#                 directory (`launch --kv-disk-dir`); after the sessions' second turns both
#                 instances are killed (SIGKILL) and the launcher restarts them: their turns
#                 3+ must come from the disk tiers the dead processes wrote
#   new-off/new-on  all-new prompts (NEW_REQUESTS of NEW_LEN tokens: nothing ever hits, every
#                 evicted block is copied out) without and with the host tiers, alternated
#                 ALTERNATIONS times: the cost of the tiers when nothing hits
#
# Workload: SESSIONS sessions × TURNS turns; each prompt is a SYSTEM-token shared system
# prompt, the session's own CONTEXT-token context (a document, tool output) and its TURN-token
# user turns so far; OUTPUT tokens per answer (`ignore_eos`), concurrency CONC. Request i is
# turn i / SESSIONS + 1 of session i % SESSIONS. Each run is driven in parts with `pdserve
# bench serve --first-request`: the first turns, then turns 2+ (in the restart run: turn 2,
# the restart, turns 3+), with `pdserve inspect --json` read after each part, so prompt
# tokens computed by the prefill instance (its prompt tokens − those it took from its prefix
# cache or tiers) are known per part. Pools: NUM_BLOCKS blocks of 16 tokens in each instance.
#
# Answers are greedy (`bench serve` sends temperature 0): every answer's text is kept
# (`--answers`) and compared, request by request, with the run without tiers.
set -euo pipefail
cd "$(dirname "$0")/.."

out=${1:-$(mktemp -d)}
mkdir -p "$out"
[ -n "${NO_BUILD:-}" ] || cargo build --release --quiet -p pdserve --bin pdserve
bin=$PWD/target/release/pdserve
model=${MODEL:-default}
sessions=${SESSIONS:-64}
turns=${TURNS:-4}
system=${SYSTEM:-1500}
context=${CONTEXT:-512}
turn=${TURN:-64}
output=${OUTPUT:-8}
conc=${CONC:-2}
blocks=${NUM_BLOCKS:-320}
threads=${THREADS:-2}
host_bytes=${HOST_BYTES:-3221225472}
new_requests=${NEW_REQUESTS:-32}
new_len=${NEW_LEN:-2048}
alternations=${ALTERNATIONS:-2}
multi_turn=(--endpoint chat --multi-turn-sessions "$sessions" --system-prompt-len "$system"
            --session-context-len "$context" --turn-len "$turn")

launch_pid="" url="" addr="" creds=""
start() {
    local name=$1
    shift
    env PDSERVE_SCHEDULER__NUM_BLOCKS="$blocks" "$@" \
        "$bin" launch --model "$model" --prefill 1 --decode 1 --port 0 --threads "$threads" \
        ${LAUNCH_ARGS:-} >"$out/$name.launch.out" 2>"$out/$name.launch.log" &
    launch_pid=$!
    url="" addr="" creds=""
    for _ in $(seq 1 1200); do
        if [ "$(wc -l <"$out/$name.launch.out")" -ge 2 ]; then
            url=$(sed -n 1p "$out/$name.launch.out")
            local inspect
            inspect=$(sed -n 2p "$out/$name.launch.out")
            addr=$(echo "$inspect" | awk '{print $4}')
            creds=$(echo "$inspect" | awk '{print $6}')
            break
        fi
        kill -0 "$launch_pid" 2>/dev/null || break
        sleep 0.5
    done
    [ -n "$url" ] || { echo "launch of $name printed no URL; see $out/$name.launch.log" >&2; exit 1; }
    wait_serving "$name"
}

# Waits (≤ 120 s) until the cluster answers a one-token request with 200 (after a start or a
# restart: the proxy routes to instances that registered).
wait_serving() {
    local served
    for _ in $(seq 1 240); do
        served=$(curl -sf "$url/v1/models" 2>/dev/null |
            python3 -c 'import json, sys; print(json.load(sys.stdin)["data"][0]["id"])' 2>/dev/null) || true
        if [ -n "$served" ] && curl -sf -o /dev/null "$url/v1/completions" \
            -H 'content-type: application/json' \
            -d '{"model":"'"$served"'","prompt":"ready","max_tokens":1}'; then
            return 0
        fi
        sleep 0.5
    done
    echo "$1: the cluster did not serve within 120 s; see $out/$1.launch.log" >&2
    exit 1
}

stop() {
    kill -TERM "$launch_pid" 2>/dev/null || true
    wait "$launch_pid" || true
}

inspect() {
    "$bin" inspect "$addr" --credentials-dir "$creds" --json >"$out/$1.inspect.json"
}

# bench NAME PART FIRST COUNT [ARGS...]: requests FIRST..FIRST+COUNT of the workload.
bench() {
    local name=$1 part=$2 first=$3 count=$4
    shift 4
    "$bin" bench serve --url "$url" "$@" --first-request "$first" --num-requests "$count" \
        --output-len "$output" --concurrency "$conc" --answers "$out/$name.$part.answers.jsonl" \
        --json >"$out/$name.$part.bench.json"
    inspect "$name.$part"
}

later=$((sessions * (turns - 1)))

start no-tiers PDSERVE_KV_TIERS__ENABLED=false
bench no-tiers turn1 0 "$sessions" "${multi_turn[@]}"
bench no-tiers later "$sessions" "$later" "${multi_turn[@]}"
stop

start host PDSERVE_KV_TIERS__ENABLED=true PDSERVE_KV_TIERS__HOST_CAPACITY_BYTES="$host_bytes"
bench host turn1 0 "$sessions" "${multi_turn[@]}"
bench host later "$sessions" "$later" "${multi_turn[@]}"
stop

rm -rf "$out/disk-tiers"
LAUNCH_ARGS="--kv-disk-dir $out/disk-tiers" start disk-restart PDSERVE_KV_TIERS__HOST_CAPACITY_BYTES=0
bench disk-restart turn1 0 "$sessions" "${multi_turn[@]}"
bench disk-restart turn2 "$sessions" "$sessions" "${multi_turn[@]}"
# Kill both instances (not the launcher, not the proxy): the launcher restarts them.
for role in prefill-0 decode-0; do
    pkill -KILL -P "$launch_pid" -f -- "--name $role " || true
done
sleep 2
wait_serving disk-restart
bench disk-restart after-restart "$((sessions * 2))" "$((sessions * (turns - 2)))" "${multi_turn[@]}"
stop

for i in $(seq 1 "$alternations"); do
    for tiers in off on; do
        name="new-$tiers-$i"
        if [ "$tiers" = on ]; then
            start "$name" PDSERVE_KV_TIERS__ENABLED=true PDSERVE_KV_TIERS__HOST_CAPACITY_BYTES="$host_bytes"
        else
            start "$name" PDSERVE_KV_TIERS__ENABLED=false
        fi
        bench "$name" all 0 "$new_requests" --endpoint completions --input-len "$new_len" \
            --seed "$((1000 + i))"
        stop
    done
done

python3 - "$out" "$sessions" "$alternations" <<'EOF'
import json, sys
out, sessions, alternations = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])

def snap(name):
    s = json.load(open(f"{out}/{name}.inspect.json"))
    inst = {m["snapshot"]["role"]: m["snapshot"] for m in s["instances"] if "snapshot" in m}
    return inst

def computed(sn):
    p = sn["prefill"]
    return p["prompt_tokens"] - p["prompt_tokens_cached"]

def hits(sn, role):
    return {t["tier"]: t["hits"] for t in sn[role].get("kv_tiers", [])}

def bench(name):
    return json.load(open(f"{out}/{name}.bench.json"))

rows = []
for name, parts in [("no-tiers", ["turn1", "later"]), ("host", ["turn1", "later"]),
                    ("disk-restart", ["turn1", "turn2", "after-restart"])]:
    snaps = [snap(f"{name}.{p}") for p in parts]
    # Counters are per process: the restart run's last part starts from zero.
    per_part = []
    prev = 0
    for p, sn in zip(parts, snaps):
        c = computed(sn)
        per_part.append(c - prev if p != "after-restart" else c)
        prev = c
    later_parts = parts[1:]
    ttft = [bench(f"{name}.{p}")["ttft_ms"] for p in later_parts]
    samples = []
    b_later = [bench(f"{name}.{p}") for p in later_parts]
    rows.append((name, bench(f"{name}.turn1")["ttft_ms"]["p50"],
                 [b["ttft_ms"]["p50"] for b in b_later], [b["ttft_ms"]["p99"] for b in b_later],
                 per_part[0], sum(per_part[1:]), hits(snaps[-1], "prefill"),
                 hits(snaps[-1], "decode"),
                 sum(b["failed"] for b in [bench(f"{name}.turn1")] + b_later)))

print(f"{'config':<13} {'turn1 p50':>9} {'turns2+ p50 (per part)':>24} {'turns2+ p99':>18} "
      f"{'computed t1':>11} {'computed 2+':>11} {'failed':>6}  tier hits (prefill | decode)")
for name, t1, p50s, p99s, c1, c2, hp, hd, failed in rows:
    print(f"{name:<13} {t1:>7.0f}ms {' / '.join(f'{v:.0f}' for v in p50s):>22}ms "
          f"{' / '.join(f'{v:.0f}' for v in p99s):>16}ms {c1:>11} {c2:>11} {failed:>6}  {hp} | {hd}")

def answers(name, parts):
    a = {}
    for p in parts:
        for line in open(f"{out}/{name}.{p}.answers.jsonl"):
            v = json.loads(line)
            a[v["index"]] = v["text"]
    return a

ref = answers("no-tiers", ["turn1", "later"])
for name, parts in [("host", ["turn1", "later"]),
                    ("disk-restart", ["turn1", "turn2", "after-restart"])]:
    a = answers(name, parts)
    same = sum(1 for i, t in a.items() if ref.get(i) == t)
    print(f"answers identical to no-tiers (greedy text): {name} {same}/{len(ref)}")

print("all-new prompts (nothing hits), TTFT p50 / mean, ms:")
for i in range(1, alternations + 1):
    off, on = bench(f"new-off-{i}.all"), bench(f"new-on-{i}.all")
    print(f"  round {i}: off {off['ttft_ms']['p50']:.0f} / {off['ttft_ms']['mean']:.0f}, "
          f"on {on['ttft_ms']['p50']:.0f} / {on['ttft_ms']['mean']:.0f} "
          f"({100 * (on['ttft_ms']['p50'] / off['ttft_ms']['p50'] - 1):+.1f} % p50), "
          f"failed {off['failed']} / {on['failed']}")
print(f"(JSON of every part in {out})")
EOF
