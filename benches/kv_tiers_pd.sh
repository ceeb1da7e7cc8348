#!/usr/bin/env bash
# KV cache tiers (issue 30) on a P/D cluster: `pdserve launch --prefill 1 --decode 1` with
# small block pools, driven by multi-turn chat sessions whose KV is many times the pools.
#
#   benches/kv_tiers_pd.sh [OUT_DIR]
#
#   no-tiers      prefix cache on, [kv_tiers] off: a session whose blocks left a pool
#                 recomputes (prefill) and moves (decode) its whole history
#   big-pool      [kv_tiers] off, pools of BIG_BLOCKS blocks that hold every session: what
#                 the tiers restore, this run keeps in the pool; the reference of the
#                 identity check (a run that recomputes a history splits the prompt into
#                 other chunks, which changes float summation order, so a near-tie can
#                 flip a greedy token against `no-tiers` without any KV being wrong)
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
# (`--answers`) and compared, request by request, with `big-pool` and with `no-tiers`.
#
# CONFIGS picks configurations (default: all, in the order above).
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
big_blocks=${BIG_BLOCKS:-4096}
new_requests=${NEW_REQUESTS:-32}
new_len=${NEW_LEN:-2048}
alternations=${ALTERNATIONS:-2}
configs=" ${CONFIGS:-no-tiers big-pool host disk-restart new} "
want() { case "$configs" in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
multi_turn=(--endpoint chat --multi-turn-sessions "$sessions" --system-prompt-len "$system"
            --session-context-len "$context" --turn-len "$turn")

launch_pid="" url="" addr="" creds=""
start() {
    local name=$1
    shift
    env PDSERVE_SCHEDULER__NUM_BLOCKS="${POOL_BLOCKS:-$blocks}" "$@" \
        "$bin" launch --model "$model" --prefill "${PREFILL:-1}" --decode 1 --port 0 \
        --threads "$threads" ${LAUNCH_ARGS:-} >"$out/$name.launch.out" 2>"$out/$name.launch.log" &
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
    # No time limit (`bench serve` stops issuing after --duration-s, 300 s by default): every
    # part sends all its requests.
    "$bin" bench serve --url "$url" "$@" --first-request "$first" --num-requests "$count" \
        --output-len "$output" --concurrency "$conc" --duration-s 86400 --timeout-s 600 \
        --answers "$out/$name.$part.answers.jsonl" --json >"$out/$name.$part.bench.json"
    inspect "$name.$part"
}

later=$((sessions * (turns - 1)))

if want no-tiers; then
    start no-tiers PDSERVE_KV_TIERS__ENABLED=false
    bench no-tiers turn1 0 "$sessions" "${multi_turn[@]}"
    bench no-tiers later "$sessions" "$later" "${multi_turn[@]}"
    stop
fi

if want big-pool; then
    POOL_BLOCKS=$big_blocks start big-pool PDSERVE_KV_TIERS__ENABLED=false
    bench big-pool turn1 0 "$sessions" "${multi_turn[@]}"
    bench big-pool later "$sessions" "$later" "${multi_turn[@]}"
    stop
fi

if want host; then
    start host PDSERVE_KV_TIERS__ENABLED=true PDSERVE_KV_TIERS__HOST_CAPACITY_BYTES="$host_bytes"
    bench host turn1 0 "$sessions" "${multi_turn[@]}"
    bench host later "$sessions" "$later" "${multi_turn[@]}"
    stop
fi

if want disk-restart; then
    rm -rf "$out/disk-tiers"
    LAUNCH_ARGS="--kv-disk-dir $out/disk-tiers" start disk-restart \
        PDSERVE_KV_TIERS__HOST_CAPACITY_BYTES=0
    bench disk-restart turn1 0 "$sessions" "${multi_turn[@]}"
    bench disk-restart turn2 "$sessions" "$sessions" "${multi_turn[@]}"
    # Kill both instances (not the launcher, not the proxy): the launcher restarts them.
    for role in prefill-0 decode-0; do
        pkill -KILL -P "$launch_pid" -f -- "--name $role " || true
    done
    sleep 2
    wait_serving disk-restart
    bench disk-restart after-restart "$((sessions * 2))" "$((sessions * (turns - 2)))" \
        "${multi_turn[@]}"
    stop
fi

if want new; then
    for i in $(seq 1 "$alternations"); do
        for tiers in off on; do
            name="new-$tiers-$i"
            if [ "$tiers" = on ]; then
                start "$name" PDSERVE_KV_TIERS__ENABLED=true \
                    PDSERVE_KV_TIERS__HOST_CAPACITY_BYTES="$host_bytes"
            else
                start "$name" PDSERVE_KV_TIERS__ENABLED=false
            fi
            bench "$name" all 0 "$new_requests" --endpoint completions --input-len "$new_len" \
                --seed "$((1000 + i))"
            stop
        done
    done
fi

python3 - "$out" "$sessions" "$alternations" <<'EOF'
import json, os, sys
out, sessions, alternations = sys.argv[1], *map(int, sys.argv[2:4])

def snap(name):
    s = json.load(open(f"{out}/{name}.inspect.json"))
    by = {}
    for m in s["instances"]:
        if "snapshot" in m:
            by.setdefault(m["snapshot"]["role"], []).append(m["snapshot"])
    return by

def computed(sn):
    return sum(p["prompt_tokens"] - p["prompt_tokens_cached"] for p in sn["prefill"])

def hits(sn, role):
    h = {}
    for inst in sn[role]:
        for t in inst.get("kv_tiers", []):
            h[t["tier"]] = h.get(t["tier"], 0) + t["hits"]
    return h

def bench(name):
    return json.load(open(f"{out}/{name}.bench.json"))

runs = [("no-tiers", ["turn1", "later"]), ("big-pool", ["turn1", "later"]),
        ("host", ["turn1", "later"]), ("disk-restart", ["turn1", "turn2", "after-restart"])]
runs = [r for r in runs if os.path.exists(f"{out}/{r[0]}.turn1.bench.json")]
print(f"{'config':<13} {'turn1 p50':>9} {'turns2+ p50 (per part)':>24} {'turns2+ p99':>18} "
      f"{'computed t1':>11} {'computed 2+':>11} {'failed':>6}  tier hits (prefill | decode)")
for name, parts in runs:
    snaps = [snap(f"{name}.{p}") for p in parts]
    # Counters are per process: the restart run's last part starts from zero.
    per_part, prev = [], 0
    for p, sn in zip(parts, snaps):
        c = computed(sn)
        per_part.append(c if p == "after-restart" else c - prev)
        prev = c
    b = [bench(f"{name}.{p}") for p in parts]
    p50s = " / ".join(f"{x['ttft_ms']['p50']:.0f}" for x in b[1:])
    p99s = " / ".join(f"{x['ttft_ms']['p99']:.0f}" for x in b[1:])
    failed = sum(x["failed"] for x in b)
    print(f"{name:<13} {b[0]['ttft_ms']['p50']:>7.0f}ms {p50s:>22}ms {p99s:>16}ms "
          f"{per_part[0]:>11} {sum(per_part[1:]):>11} {failed:>6}  "
          f"{hits(snaps[-1], 'prefill')} | {hits(snaps[-1], 'decode')}")

def answers(name, parts):
    a = {}
    for p in parts:
        for line in open(f"{out}/{name}.{p}.answers.jsonl"):
            v = json.loads(line)
            a[v["index"]] = v["text"]
    return a

got = {name: answers(name, parts) for name, parts in runs}
for ref in ["big-pool", "no-tiers"]:
    if ref not in got:
        continue
    for name in got:
        if name != ref:
            same = sum(1 for k, t in got[name].items() if got[ref].get(k) == t)
            print(f"answers identical to {ref} (greedy text, by request): {name} "
                  f"{same}/{len(got[name])}")

if os.path.exists(f"{out}/new-off-1.all.bench.json"):
    print("all-new prompts (nothing hits), TTFT p50 / mean, ms:")
    for i in range(1, alternations + 1):
        off, on = bench(f"new-off-{i}.all"), bench(f"new-on-{i}.all")
        print(f"  round {i}: off {off['ttft_ms']['p50']:.0f} / {off['ttft_ms']['mean']:.0f}, "
              f"on {on['ttft_ms']['p50']:.0f} / {on['ttft_ms']['mean']:.0f} "
              f"({100 * (on['ttft_ms']['p50'] / off['ttft_ms']['p50'] - 1):+.1f} % p50), "
              f"failed {off['failed']} / {on['failed']}")
print(f"(JSON of every part in {out})")
EOF
