#!/usr/bin/env bash
# `pdserve serve` beside llama.cpp's `llama-server` as users meet them: served, same GGUF, both
# with 2 threads, driven one after the other by the same external client (`pdserve bench
# serve`, chat endpoint, `ignore_eos`), at concurrency 1 and 8 with prompts of ~600 and ~2500
# tokens. Usage:
#   benches/serve_vs_llamaserver.sh LLAMA_SERVER [MODEL.gguf]
# Environment: PDSERVE (binary, default target/release/pdserve), KV_DTYPES (pdserve's
# `scheduler.kv_cache_dtype` values to run, default "f32 f16"), OUTPUT_LEN (default 64),
# CELLS (default "1:600 1:2500 8:600 8:2500", concurrency:input tokens), BASELINE (an older
# pdserve binary, run after the new one as "baseline-kv-…" with the same settings), NICE_CELLS
# (cells run again, after the idle ones, for every server with one `nice -n 19` busy loop
# beside it, as "…+nice"; default none: e.g. "1:600 1:2500"), SKIP_LLAMA (set: pdserve only).
# Prints one JSON line per (server, cell): `pdserve bench serve --json` plus the cell.
set -euo pipefail
LS=${1:?path to llama-server}
MODEL=${2:-${PDSERVE_HOME:-$HOME/.cache/pdserve}/models/SmolLM2-135M-Instruct.Q4_1.gguf}
PD=${PDSERVE:-target/release/pdserve}
OUT=${OUTPUT_LEN:-64}
CELLS=${CELLS:-"1:600 1:2500 8:600 8:2500"}
PORT=$((20000 + RANDOM % 20000))
SERVER=""
BUSY=""
# (A process killed by the signal exits non-zero: `|| true`, or `set -e` ends the script.)
stop() { [ -z "$SERVER" ] || { kill "$SERVER" 2>/dev/null; wait "$SERVER" 2>/dev/null || true; }; SERVER=""; }
stop_busy() { [ -z "$BUSY" ] || { kill "$BUSY" 2>/dev/null; wait "$BUSY" 2>/dev/null || true; }; BUSY=""; }
trap 'stop; stop_busy' EXIT
wait_up() {
  for _ in $(seq 1 240); do
    curl -sf "http://127.0.0.1:$PORT/v1/models" >/dev/null 2>&1 && return 0
    sleep 0.5
  done
  echo "server on $PORT did not come up" >&2
  return 1
}
run_cells() {
  local name=$1
  for cell in $CELLS; do
    run_cell "$name" "$cell"
  done
  if [ -n "${NICE_CELLS:-}" ]; then
    nice -n 19 sh -c 'while :; do :; done' &
    BUSY=$!
    for cell in $NICE_CELLS; do
      run_cell "$name+nice" "$cell"
    done
    stop_busy
  fi
}
run_cell() {
  local name=$1 cell=$2
  local c=${cell%%:*} len=${cell##*:}
  local n=$((2 * c < 4 ? 4 : 2 * c))
  local json
  json=$("$PD" bench serve --url "http://127.0.0.1:$PORT" --endpoint chat --concurrency "$c" \
    --num-requests "$n" --input-len "$len" --output-len "$OUT" --seed 1 --timeout-s 600 --json)
  echo "{\"server\":\"$name\",\"concurrency\":$c,\"input_len\":$len,\"result\":$json}"
}
echo "# $(date -u +%FT%TZ) load: $(cut -d' ' -f1-3 /proc/loadavg)"
# llama-server: one slot per concurrent request, each slot room for a prompt and its output.
if [ -z "${SKIP_LLAMA:-}" ]; then
  "$LS" -m "$MODEL" -t 2 -np 8 -c $((8 * 4096)) -to 600 --port "$PORT" --host 127.0.0.1 >/dev/null 2>&1 &
  SERVER=$!
  wait_up
  run_cells llama-server
  stop
fi
for kv in ${KV_DTYPES:-f32 f16}; do
  for bin in "$PD" ${BASELINE:-}; do
    name=pdserve-kv-$kv
    [ "$bin" = "$PD" ] || name=baseline-kv-$kv
    PDSERVE_SCHEDULER__KV_CACHE_DTYPE=$kv "$bin" serve --model "$MODEL" --threads 2 \
      --port "$PORT" >/dev/null 2>&1 &
    SERVER=$!
    wait_up
    run_cells "$name"
    stop
  done
done
echo "# end load: $(cut -d' ' -f1-3 /proc/loadavg)"
