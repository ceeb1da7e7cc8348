#!/usr/bin/env bash
# Verifies the CUDA backend on a machine with an NVIDIA GPU (see docs/cuda.md).
#
#   benches/cuda_verify.sh [PDSERVE_BINARY] [OUT_DIR]
#
# PDSERVE_BINARY must be built with `--features cuda` (GPU machines reach no package registry:
# build it elsewhere and carry it). OUT_DIR (default $OUT, else ./cuda-verify-out) receives:
#   probe.json          driver version and device count
#   verify-f32.json     GPU (f32 weights) vs CPU (f32 weights): greedy tokens for 3 prompts x 32
#                       tokens, first divergence with logit margins, the P/D hand-offs
#                       (GPU prefill -> KV bytes -> CPU decode; -> second GPU group), GPU
#                       prefill/decode tokens/s at batch 1 and 32, KV transfer GB/s
#                       device -> host -> device beside plain cuMemcpy
#   verify-f16.json     GPU f16 vs the CPU's default format (Q8_0): same checks, no speed
#   verify-hf.json      pdserve on the HF export of the same weights (f16), with speed
#   hf.json             HF transformers on that export: greedy tokens from the same prompt ids
#                       (compared with verify-hf.json) and prefill/decode tokens/s at batch 1/32
#   bench-model.txt     `pdserve bench model --device cuda` on the synthetic GGUF
# The model is a seeded synthetic model of SmolLM2-135M's shape (the real GGUF is larger than
# what can be carried to the GPU machine); `--model PATH` of `pdserve cuda verify` takes any other.
set -euo pipefail
cd "$(dirname "$0")/.."
bin="${1:-target/release/pdserve}"
out="${2:-${OUT:-cuda-verify-out}}"
mkdir -p "$out"
bin="$(realpath "$bin")"
out="$(realpath "$out")"
export PDSERVE_HOME="$out/home"
export PYTHONUNBUFFERED=1

# Kernels: PTX precompiled elsewhere (`pdserve cuda compile --out .gpu/cuda-kernels`) needs no
# NVRTC here; otherwise NVRTC from the CUDA toolkit or the pip wheels of the Python install.
if [ -d .gpu/cuda-kernels ]; then
    export PDSERVE_CUDA_KERNELS="$PWD/.gpu/cuda-kernels"
fi
libdirs=(/usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib)
while IFS= read -r d; do libdirs+=("$d"); done < <(python3 - <<'PY' 2>/dev/null || true
import glob, os, site
for base in site.getsitepackages():
    for d in glob.glob(os.path.join(base, "nvidia", "*", "lib")):
        print(d)
PY
)
if [ -z "${PDSERVE_NVRTC_LIB:-}" ]; then
    for d in "${libdirs[@]}"; do
        for n in libnvrtc.so.13 libnvrtc.so.12; do
            if [ -f "$d/$n" ]; then export PDSERVE_NVRTC_LIB="$d/$n"; break 2; fi
        done
    done
fi
# cuBLAS is loaded by cudarc by its soname: make its directory findable.
for d in "${libdirs[@]}"; do
    if ls "$d"/libcublas.so* >/dev/null 2>&1; then
        export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
    fi
done
echo "NVRTC: ${PDSERVE_NVRTC_LIB:-none (PTX cache ${PDSERVE_CUDA_KERNELS:-none})}" | tee "$out/env.txt"
echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}" | tee -a "$out/env.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee -a "$out/env.txt" || true

"$bin" cuda probe --json | tee "$out/probe.json"

step() { echo "== $*" >&2; }
step "greedy, hand-offs, speed and KV transfer: GPU f32 vs CPU f32"
"$bin" cuda verify --dtype f32 --cpu-weights f32 --tokens 32 --bench --json \
    --export-hf "$out/hf-model" >"$out/verify-f32.json"
step "greedy and hand-offs: GPU f16 vs CPU auto (Q8_0)"
"$bin" cuda verify --dtype f16 --cpu-weights auto --tokens 32 --json >"$out/verify-f16.json"
step "pdserve on the HF export (f16), with speed"
"$bin" cuda verify --model "$out/hf-model" --dtype f16 --cpu-weights f32 --tokens 32 --bench \
    --json >"$out/verify-hf.json"
step "HF transformers on the same HF export"
python3 benches/cuda_hf_reference.py "$out/hf-model" "$out/verify-hf.json" >"$out/hf.json" \
    || echo "HF transformers reference failed (see above)" >&2
step "pdserve bench model --device cuda"
"$bin" bench model --device cuda --dtype f16 \
    --model "$PDSERVE_HOME/cuda-verify/synthetic-smollm.Q4_1.gguf" | tee "$out/bench-model.txt"

python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
for name in ["verify-f32", "verify-f16", "verify-hf"]:
    r = json.load(open(f"{out}/{name}.json"))
    print(f"{name}: dtype {r['dtype']} vs CPU {r['cpu_format']}")
    for g in r["greedy"]:
        d = g["divergence"]
        tail = "identical" if d is None else (
            f"diverges at {d['step']}: cpu margin {d['cpu_margin']:.4f}, gpu margin "
            f"{d['gpu_margin']:.4f}, max |logit diff| {d['max_logit_diff']:.4f}")
        print(f"  prompt {len(g['prompt_ids'])} tok: {g['matched']}/{len(g['cpu'])} match, {tail}")
    for h in r["handoff"]:
        print(f"  {h['name']}: {'identical' if h['identical'] else 'DIFFERENT'}")
    if r.get("speed"):
        print("  speed:", json.dumps(r["speed"]))
    if r.get("transfer"):
        print("  transfer:", json.dumps(r["transfer"]))
try:
    print("hf:", json.dumps(json.load(open(f"{out}/hf.json"))))
except Exception as e:
    print("hf: not available:", e)
PY
