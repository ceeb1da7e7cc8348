#!/usr/bin/env bash
# `pdserve bench model` beside llama.cpp's own `llama-bench`, same GGUF, same run, 1 and 2
# threads. Usage: [WEIGHTS=auto|native] [KV=f32|f16] [CONTEXTS=512,2048,8000]
# benches/model_vs_llamacpp.sh LLAMA_BENCH [MODEL.gguf] (llama-bench build recipe:
# docs/benchmarks.md). Prints both tools' output per thread count: prefill, decode, and batch-1
# decode at each context length (llama-bench `-d`, the same depths).
set -euo pipefail
LB=${1:?path to llama-bench}
MODEL=${2:-${PDSERVE_HOME:-$HOME/.cache/pdserve}/models/SmolLM2-135M-Instruct.Q4_1.gguf}
PD=${PDSERVE:-target/release/pdserve}
echo "# $(date -u +%FT%TZ) load: $(cut -d' ' -f1-3 /proc/loadavg)"
for t in 1 2; do
  echo "## threads $t"
  "$PD" bench model --model "$MODEL" --threads "$t" --decode-steps 128 --weights "${WEIGHTS:-auto}" \
    --kv-dtype "${KV:-f32}" --contexts "${CONTEXTS:-512,2048,8000}" --json
  "$LB" -m "$MODEL" -t "$t" -p 512 -n 64,128 -r 3 -o md 2>/dev/null | grep -E "^\| (model|llama)"
  "$LB" -m "$MODEL" -t "$t" -p 0 -n 64 -d "${CONTEXTS:-512,2048,8000}" -r 2 -o md 2>/dev/null | grep -E "^\| (model|llama)"
done
echo "# end load: $(cut -d' ' -f1-3 /proc/loadavg)"
