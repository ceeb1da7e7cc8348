#!/usr/bin/env bash
# `pdserve serve` beside llama.cpp's `llama-server` as users meet them: served, same GGUF, both
# with 2 threads, driven one after the other by the same external client (`pdserve bench
# serve`, chat endpoint, `ignore_eos`), at concurrency 1 and 8 with prompts of ~600 and ~2500
# tokens. Usage:
#   benches/serve_vs_llamaserver.sh LLAMA_SERVER [MODEL.gguf]
# Environment: PDSERVE (binary, default target/release/pdserve), KV_DTYPES (pdserve's
# `scheduler.kv_cache_dtype` values to run, default "f32 f16"), OUTPUT_LEN (default 64),
# CELLS (default "1:600 1:2500 8:600 8:2500", concurrency:input tokens).
# Prints one JSON line per (server, cell): `pdserve bench serve --json` plus the cell.
set -euo pipefail
LS=${1:?path to llama-server}
MODEL=${2:-${PDSERVE_HOME:-$HOME/.cache/pdserve}/models/SmolLM2-135M-Instruct.Q4_1.gguf}
PD=${PDSERVE:-target/release/pdserve}
OUT=${OUTPUT_LEN:-64}
CELLS=${CELLS:-"1:600 1:2500 8:600 8:2500"}
PORT=$((20000 + RANDOM % 20000))
SERVER=""
stop() { [ -n "$SERVER" ] && kill "$SERVER" 2>/dev/null && wait "$SERVER" 2>/dev/null; SERVER=""; }
trap stop EXIT
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
    local c=${cell%%:*} len=${cell##*:}
    local n=$((2 * c < 4 ? 4 : 2 * c))
    local json
    json=$("$PD" bench serve --url "http://127.0.0.1:$PORT" --endpoint chat --concurrency "$c" \
      --num-requests "$n" --input-len "$len" --output-len "$OUT" --seed 1 --timeout-s 600 --json)
    echo "{\"server\":\"$name\",\"concurrency\":$c,\"input_len\":$len,\"result\":$json}"
  done
}
echo "# $(date -u +%FT%TZ) load: $(cut -d' ' -f1-3 /proc/loadavg)"
# llama-server: one slot per concurrent request, each slot room for a prompt and its output.
"$LS" -m "$MODEL" -t 2 -np 8 -c $((8 * 4096)) -to 600 --port "$PORT" --host 127.0.0.1 >/dev/null 2>&1 &
SERVER=$!
wait_up
run_cells llama-server
stop
for kv in ${KV_DTYPES:-f32 f16}; do
  PDSERVE_SCHEDULER__KV_CACHE_DTYPE=$kv "$PD" serve --model "$MODEL" --threads 2 \
    --port "$PORT" >/dev/null 2>&1 &
  SERVER=$!
  wait_up
  run_cells "pdserve-kv-$kv"
  stop
done
echo "# end load: $(cut -d' ' -f1-3 /proc/loadavg)"
