#!/usr/bin/env bash
# pdserve's transfer engine (every backend, authenticated sessions, tcp with each frame
# protection) beside the limit of its medium and beside Mooncake's transfer engine (tcp), in
# one run on this machine. Prints one table and the checks issue 16 asks for.
#
#   cargo build --release --bin pdserve -p pdserve && \
#     cargo build --release -p pdserve-transport --bin pdserve-transfer-peer
#   python3 -m venv /tmp/mc && /tmp/mc/bin/pip install mooncake-transfer-engine-non-cuda
#   apt-get install -y libibverbs1          # the wheel links it, even for tcp
#   MOONCAKE_PYTHON=/tmp/mc/bin/python benches/transfer_vs_mooncake.sh
#
# Run it on an idle machine: both engines and the peers share its cores.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${MOONCAKE_PYTHON:-python3}
PDSERVE=${PDSERVE:-target/release/pdserve}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

echo "machine: $(nproc) cores; load: $(cut -d' ' -f1-3 /proc/loadavg)"
"$PDSERVE" bench transfer --json > "$out/pdserve.json"
"$PY" benches/mooncake_transfer.py > "$out/mooncake.json" 2> "$out/mooncake.log" || {
    echo "Mooncake's transfer engine did not run:" >&2
    tail -20 "$out/mooncake.log" >&2
    exit 1
}
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"

python3 - "$out/pdserve.json" "$out/mooncake.json" <<'PYEOF'
import json, sys

rows = json.load(open(sys.argv[1])) + json.load(open(sys.argv[2]))
mooncake = {r["size_bytes"]: r["gbps"] for r in rows if r["backend"] == "mooncake-tcp"}
def human(n):
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"
limits = "limit's"
print(f"{'backend':<13} {'auth':<4} {'size':>7} {'GB/s':>7} {'limit':>7} {'×limit':>7} {'×mooncake':>9} {'lat µs':>9} {'CPU-s/GB':>9} {limits:>8}")
def cpu(v):
    return "%.3f" % v if v is not None else "-"
for r in rows:
    limit = r.get("limit_gbps")
    limit_s = "%.2f" % limit if limit else "-"
    ratio = "%.2f" % (r["gbps"] / limit) if limit else "-"
    mc = mooncake.get(r["size_bytes"])
    vs_mc = "%.2f" % (r["gbps"] / mc) if mc else "-"
    auth = "key" if r.get("auth") else "-"
    print(f"{r['backend']:<13} {auth:<4} {human(r['size_bytes']):>7} {r['gbps']:>7.2f} "
          f"{limit_s:>7} {ratio:>7} {vs_mc:>9} {r['latency_us']:>9.1f} "
          f"{cpu(r.get('cpu_s_per_gb')):>9} {cpu(r.get('limit_cpu_s_per_gb')):>8}")

by = {(r["backend"], r["size_bytes"]): r for r in rows}
print()
for size in sorted({r["size_bytes"] for r in rows}):
    if size < 1 << 20:
        continue
    q, t, m = by.get(("quic", size)), by.get(("tcp", size)), by.get(("tcp+mac", size))
    s = by.get(("shm", size))
    if s:
        print(f"check {human(size):>7}: shm / memcpy       = {s['gbps'] / s['limit_gbps']:.2f} (goal ≥ 0.9)")
    if q:
        print(f"check {human(size):>7}: quic / plain socket = {q['gbps'] / q['limit_gbps']:.2f} (goal ≥ 0.8)")
    if t and m:
        print(f"check {human(size):>7}: tcp+mac / tcp      = {m['gbps'] / t['gbps']:.2f} (goal ≥ 0.8)")
PYEOF
