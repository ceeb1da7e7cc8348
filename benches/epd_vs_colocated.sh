#!/usr/bin/env bash
# Encoder disaggregation (E/P/D) against one colocated instance, served, with images.
#
#   benches/epd_vs_colocated.sh [options] [PDSERVE_BIN]
#
# Two setups of the same vision-language model, measured alternately in one run (round r:
# colocated, then E+P+D), each freshly started for every round:
#   colocated  one `pdserve serve` (its own vision tower, encoder cache, prefill and decode)
#   epd        `pdserve launch --encode 1`: proxy, 1 encode, 1 prefill, 1 decode instance
#              (shm transport); the proxy sends each request with images to the encoder
#              first, decode drives prefill, prefill takes the embeddings from the encoder
# Workloads, each at every concurrency (closed loop: C clients, each sending its next request
# when its last answer ended), streamed chat requests with one image, greedy, ignore_eos:
#   fresh      every request a new image (every image encoded)
#   repeated   4 images cycled (after the first 4, every image a cache hit)
# The client (python3, standard library) measures per request the time to the first content
# chunk (TTFT) and the end; it reports TTFT p50/p90, requests/s and output tokens/s.
#
# Options (defaults): --requests 24  --warmup 2  --rounds 1  --concurrency "1 4"
#   --max-tokens 32  --threads 2 (compute threads of each instance)
#   --model synthetic:small,vision=1,vision_size=224,vision_patch=16,vision_hidden=384,vision_layers=6,context=2048
#   --out DIR (a fresh temporary directory; logs and results.csv stay there)
# The default synthetic VLM has a tower of a few GFLOP per image (49 positions); a real VLM
# can be given as --model when one is at hand.
set -euo pipefail

REQUESTS=24 WARMUP=2 ROUNDS=1 CONC="1 4" MAXTOK=32 THREADS=2 OUT=""
MODEL="synthetic:small,vision=1,vision_size=224,vision_patch=16,vision_hidden=384,vision_layers=6,context=2048"
BIN=""
while [ $# -gt 0 ]; do
    case "$1" in
        --requests) REQUESTS=$2; shift 2 ;;
        --warmup) WARMUP=$2; shift 2 ;;
        --rounds) ROUNDS=$2; shift 2 ;;
        --concurrency) CONC=$2; shift 2 ;;
        --max-tokens) MAXTOK=$2; shift 2 ;;
        --threads) THREADS=$2; shift 2 ;;
        --model) MODEL=$2; shift 2 ;;
        --out) OUT=$2; shift 2 ;;
        -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
        -*) echo "unknown option $1" >&2; exit 2 ;;
        *) BIN=$(realpath "$1"); shift ;;
    esac
done
cd "$(dirname "$0")/.."
if [ -z "$BIN" ]; then
    cargo build --release --quiet --bin pdserve
    BIN=$(realpath target/release/pdserve)
fi
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
echo "results in $OUT" >&2

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

wait_ready() { # URL LOGFILE
    for _ in $(seq 1 600); do
        curl -sf "$1/health" >/dev/null 2>&1 && return 0
        sleep 0.2
    done
    echo "not ready: $1 (see $2)" >&2
    return 1
}

client() { # URL SETUP WORKLOAD CONCURRENCY ROUND
    python3 - "$@" "$REQUESTS" "$WARMUP" "$MAXTOK" "$OUT/results.csv" <<'EOF'
import base64, http.client, json, struct, sys, threading, time, urllib.parse, zlib
url, setup, workload, conc, rnd, requests, warmup, maxtok, csv = sys.argv[1:]
conc, requests, warmup, maxtok = int(conc), int(requests), int(warmup), int(maxtok)
u = urllib.parse.urlparse(url)

def png(seed, w=256, h=192):
    # A noisy RGB PNG (does not compress away), different for every seed.
    state = (seed * 2654435761 + 12345) & 0xffffffff
    rows = []
    for _ in range(h):
        row = bytearray(b"\x00")
        for _ in range(3 * w):
            state ^= (state << 13) & 0xffffffff
            state ^= state >> 17
            state ^= (state << 5) & 0xffffffff
            row.append(state & 0xff)
        rows.append(bytes(row))
    def chunk(t, d):
        return struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d) & 0xffffffff)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"".join(rows), 1)) + chunk(b"IEND", b""))

total = warmup + requests
if workload == "fresh":
    seeds = [1000 * int(rnd) + 7919 * (1 + hash(setup) % 97) + i for i in range(total)]
else:
    seeds = [i % 4 for i in range(total)]
images = {s: "data:image/png;base64," + base64.b64encode(png(s)).decode() for s in set(seeds)}

def body(i):
    return json.dumps({
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "Describe this picture: "},
            {"type": "image_url", "image_url": {"url": images[seeds[i]]}}]}],
        "max_tokens": maxtok, "temperature": 0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True}})

results, lock, nxt = [], threading.Lock(), [0]
def worker():
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    while True:
        with lock:
            i = nxt[0]
            if i >= total:
                return
            nxt[0] += 1
        t0 = time.perf_counter(); ttft = None; toks = 0
        conn.request("POST", "/v1/chat/completions", body(i), {"content-type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            raise SystemExit(f"HTTP {r.status}: {r.read()[:300]}")
        for line in r:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                toks = ev["usage"]["completion_tokens"]
            if ttft is None and ev.get("choices") and ev["choices"][0]["delta"].get("content") is not None:
                ttft = time.perf_counter() - t0
        end = time.perf_counter()
        with lock:
            results.append((i, t0, ttft, end, toks))

# Warm-up first, alone; then the measured requests.
nxt[0] = 0
saved = total
total = warmup
for t in [threading.Thread(target=worker) for _ in range(1)]:
    t.start(); t.join()
results.clear()
total = saved
threads = [threading.Thread(target=worker) for _ in range(conc)]
for t in threads: t.start()
for t in threads: t.join()
start = min(r[1] for r in results); stop = max(r[3] for r in results)
ttfts = sorted(r[2] for r in results)
q = lambda p: ttfts[min(len(ttfts) - 1, int(p * len(ttfts)))]
rps = len(results) / (stop - start)
tps = sum(r[4] for r in results) / (stop - start)
line = f"{setup},{workload},{conc},{rnd},{len(results)},{q(0.5)*1000:.1f},{q(0.9)*1000:.1f},{rps:.3f},{tps:.1f}"
with open(csv, "a") as f:
    f.write(line + "\n")
print(line)
EOF
}

[ -f "$OUT/results.csv" ] || echo "setup,workload,concurrency,round,requests,ttft_p50_ms,ttft_p90_ms,req_per_s,out_tok_per_s" > "$OUT/results.csv"
export PDSERVE_LOG=warn
for r in $(seq 1 "$ROUNDS"); do
    for setup in colocated epd; do
        log="$OUT/$setup-$r.log"
        if [ "$setup" = colocated ]; then
            port=$(free_port)
            "$BIN" serve --model "$MODEL" --port "$port" --threads "$THREADS" >"$log" 2>&1 &
            pid=$!
            url="http://127.0.0.1:$port"
        else
            port=$(free_port)
            "$BIN" launch --model "$MODEL" --encode 1 --port "$port" --threads "$THREADS" >"$log" 2>&1 &
            pid=$!
            url="http://127.0.0.1:$port"
        fi
        wait_ready "$url" "$log"
        for w in fresh repeated; do
            for c in $CONC; do
                client "$url" "$setup" "$w" "$c" "$r"
            done
        done
        kill -TERM "$pid"; wait "$pid" || true
    done
done
echo
column -s, -t "$OUT/results.csv"
