#!/usr/bin/env bash
# P/D hand-off gap: from the prefill instance having a prompt computed (its last chunk) to the
# decode instance planning that request's first decode step.
#
#   benches/handoff_latency.sh [options] PDSERVE_BIN [PDSERVE_BIN...]
#
# For every transport (shm, tcp) and mode (pull, push) it starts a single-node 1P1D cluster
# with `PDSERVE_BIN launch`, sends sequential /v1/completions with a token-id prompt
# (max_tokens 2, temperature 0, ignore_eos) through the proxy, and joins the two INFO log
# lines every hand-off writes, by transfer id:
#   prefill: `handoff: prompt computed`     transfer=<id> at_us=<µs since the Unix epoch>
#   decode:  `handoff: first decode step`   transfer=<id> at_us=<...>
# gap = first_decode_step.at_us - prompt_computed.at_us (both processes on one host, one
# clock). The first --warmup hand-offs of every run are dropped. With several binaries the
# runs interleave (round r: bin1, bin2, ... for each transport/mode) so background load hits
# them alike; samples of all rounds are pooled per binary/transport/mode.
#
# Binaries older than 09598c3 do not write these lines; see docs/benchmarks.md for the
# measurement-only patch that adds them.
#
# Options (defaults): --requests 50  --warmup 3  --rounds 1  --prompt-tokens 1000
#   --model synthetic:small,context=2048  --threads 1  --transports "shm tcp"
#   --modes "pull push"  --out DIR (a fresh temporary directory; logs and gaps.csv stay there)
#   --first-round 1 (more rounds into an existing --out DIR, same binaries in the same order:
#   the statistics cover every run logged in DIR)
set -euo pipefail

REQUESTS=50 WARMUP=3 ROUNDS=1 FIRST_ROUND=1 PROMPT=1000 THREADS=1
MODEL="synthetic:small,context=2048"
TRANSPORTS="shm tcp" MODES="pull push" OUT=""
BINS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --requests) REQUESTS=$2; shift 2 ;;
        --warmup) WARMUP=$2; shift 2 ;;
        --rounds) ROUNDS=$2; shift 2 ;;
        --first-round) FIRST_ROUND=$2; shift 2 ;;
        --prompt-tokens) PROMPT=$2; shift 2 ;;
        --model) MODEL=$2; shift 2 ;;
        --threads) THREADS=$2; shift 2 ;;
        --transports) TRANSPORTS=$2; shift 2 ;;
        --modes) MODES=$2; shift 2 ;;
        --out) OUT=$2; shift 2 ;;
        -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
        -*) echo "unknown option $1" >&2; exit 2 ;;
        *) BINS+=("$(realpath "$1")"); shift ;;
    esac
done
[ ${#BINS[@]} -gt 0 ] || { echo "usage: $0 [options] PDSERVE_BIN [PDSERVE_BIN...]" >&2; exit 2; }
for b in "${BINS[@]}"; do [ -x "$b" ] || { echo "not executable: $b" >&2; exit 2; }; done
[ -n "$OUT" ] || OUT=$(mktemp -d /tmp/handoff-latency.XXXXXX)
mkdir -p "$OUT"
echo "logs in $OUT" >&2

LAUNCHER=""
cleanup() {
    if [ -n "$LAUNCHER" ] && kill -0 "$LAUNCHER" 2>/dev/null; then
        kill -TERM "$LAUNCHER" 2>/dev/null || true
        wait "$LAUNCHER" 2>/dev/null || true
    fi
}
trap cleanup EXIT

# One run: launch, wait for the proxy URL, send the requests, stop the cluster.
run_one() { # bin_index transport mode round
    local bin=${BINS[$1]} tag="b$1-$2-$3-r$4"
    local log="$OUT/$tag.log" url="" i
    PDSERVE_LOG=info "$bin" launch --model "$MODEL" --transport "$2" --mode "$3" \
        --port 0 --threads "$THREADS" >"$OUT/$tag.stdout" 2>"$log" &
    LAUNCHER=$!
    for i in $(seq 1 1800); do
        url=$(grep -m1 -o '^http://[^ ]*' "$OUT/$tag.stdout" 2>/dev/null || true)
        [ -n "$url" ] && break
        kill -0 "$LAUNCHER" 2>/dev/null || { echo "launcher exited; see $log" >&2; return 1; }
        sleep 0.1
    done
    [ -n "$url" ] || { echo "no proxy URL after 180 s; see $log" >&2; return 1; }
    python3 - "$url" "$REQUESTS" "$PROMPT" <<'EOF'
import json, random, sys, urllib.error, urllib.request
url, n, plen = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
rng = random.Random(7)
for i in range(n):
    # Fresh random ids each time (no prefix reuse); < 256 fits every synthetic vocabulary.
    body = {"prompt": [rng.randrange(1, 256) for _ in range(plen)],
            "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with opener.open(req, timeout=120) as r:
            out = json.load(r)
    except urllib.error.HTTPError as e:
        sys.exit(f"request {i}: HTTP {e.code}: {e.read()[:500]!r}")
    if out.get("usage", {}).get("completion_tokens") != 2:
        sys.exit(f"request {i}: unexpected answer {out}")
EOF
    kill -TERM "$LAUNCHER" 2>/dev/null || true
    wait "$LAUNCHER" 2>/dev/null || true
    LAUNCHER=""
}

for r in $(seq "$FIRST_ROUND" $((FIRST_ROUND + ROUNDS - 1))); do
    for t in $TRANSPORTS; do
        for m in $MODES; do
            for b in "${!BINS[@]}"; do
                echo "round $r: ${BINS[$b]} $t $m" >&2
                run_one "$b" "$t" "$m" "$r"
            done
        done
    done
done

printf '%s\n' "${BINS[@]}" >"$OUT/bins.txt"
python3 - "$OUT" "$WARMUP" <<'EOF'
import glob, os, re, sys
out, warmup = sys.argv[1], int(sys.argv[2])
bins = open(os.path.join(out, "bins.txt")).read().split("\n")
ansi = re.compile(r"\x1b\[[0-9;]*m")
tid = re.compile(r'transfer"?[=:]\s*"?([0-9a-f]{32})')
at = re.compile(r'at_us"?[=:]\s*"?(\d+)')
samples = {}
csv = open(os.path.join(out, "gaps.csv"), "w")
csv.write("binary,transport,mode,round,seq,transfer,gap_us\n")
for path in sorted(glob.glob(os.path.join(out, "b*-r*.log"))):
    b, t, m, r = re.match(r"b(\d+)-(\w+)-(\w+)-r(\d+)\.log", os.path.basename(path)).groups()
    computed, stepped = {}, {}
    order = []
    for line in open(path, errors="replace"):
        line = ansi.sub("", line)
        kind = ("c" if "handoff: prompt computed" in line
                else "s" if "handoff: first decode step" in line else None)
        if not kind:
            continue
        x, y = tid.search(line), at.search(line)
        if not (x and y):
            continue
        d = computed if kind == "c" else stepped
        d.setdefault(x.group(1), int(y.group(1)))
        if kind == "c":
            order.append(x.group(1))
    gaps = [(tr, stepped[tr] - computed[tr]) for tr in order if tr in stepped]
    if len(gaps) < len(order):
        print(f"{path}: {len(order) - len(gaps)} hand-offs without a first decode step",
              file=sys.stderr)
    for i, (tr, g) in enumerate(gaps):
        csv.write(f"{bins[int(b)]},{t},{m},{r},{i},{tr},{g}\n")
    samples.setdefault((int(b), t, m), []).extend(g for _, g in gaps[warmup:])
csv.close()

def pct(v, p):  # nearest rank
    v = sorted(v)
    return v[max(0, min(len(v) - 1, -(-p * len(v) // 100) - 1))]

print(f"{'binary':<40} {'transport':<9} {'mode':<5} {'n':>4} {'p50 ms':>8} {'p99 ms':>8} {'mean ms':>8}")
for (b, t, m), v in sorted(samples.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
    if not v:
        continue
    print(f"{bins[b]:<40} {t:<9} {m:<5} {len(v):>4} {pct(v, 50) / 1e3:>8.2f} "
          f"{pct(v, 99) / 1e3:>8.2f} {sum(v) / len(v) / 1e3:>8.2f}")
EOF
