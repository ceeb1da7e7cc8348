#!/usr/bin/env python3
"""Regenerate smollm2_tokens.json: llama.cpp's tokenization of varied strings with the default
model's GGUF, the reference that gpu/tests/tokenizer.rs checks our tokenizer against.

Needs llama-cpp-python (`pip install llama-cpp-python`) and the GGUF, which
`pdserve model pull` (or the gpu tests) put under $PDSERVE_HOME/models/.

Usage: python3 gen_tokenizer_fixture.py [path/to/SmolLM2-135M-Instruct.Q4_1.gguf]
"""

import json
import os
import sys

import llama_cpp

CASES = [
    "Hello world 12345",
    "The quick brown fox costs $3.50.",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n",
    "<|endoftext|>text after end<|endoftext|>",
    "  two leading spaces, three trailing   ",
    "tabs\tand\ttabs\t\t\tand a newline\nand two\n\nand three\n\n\n",
    "Windows line endings\r\nsecond line\r\n",
    "emoji 🤖🎉👍🏽 and a family 👨‍👩‍👧",
    "CJK: 你好，世界！日本語のテキスト、한국어 텍스트",
    "accents: déjà vu, naïve café, Ångström, Ελληνικά, русский текст",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "fn main() {\n\tlet x: Vec<u32> = (0..10).map(|i| i * 2).collect();\n\tprintln!(\"{x:?}\");\n}",
    "<html><body class=\"main\">&nbsp;&lt;tag&gt;</body></html>",
    "numbers: 0 1 12 123 1234 12345678901234567890 3.14159 -42 1e-9 0x1F",
    "dates 2024-01-31 and times 23:59:59, phone +1 (555) 123-4567",
    "I'm sure they'll say it's what we've done, you'd think; DON'T SHOUT, I'LL",
    "punctuation!!! ??? ... --- ___ *** ((())) [[]] {{}} ~~~ ^^^ |||",
    "mixed    multiple     spaces      between       words",
    "   \n  \t \n",
    "a",
    " ",
    "\n",
    "URL-like: https://example.com/path?query=1&x=y#frag and email a.b@c.org",
    "Math: ∑_{i=1}^{n} i² = n(n+1)/2, √2 ≈ 1.41421, ∞ ≠ −∞",
    "SmolLM2 is a family of compact language models available in three sizes: 135M, 360M, and 1.7B parameters.",
    "JSON: {\"key\": [1, 2, {\"nested\": null}], \"ok\": true}",
    "<|im_start|>user\nWrite a haiku about 🌸 in 日本語<|im_end|>\n<|im_start|>assistant\n",
]


def default_model_path():
    home = os.environ.get("PDSERVE_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "pdserve")
    return os.path.join(home, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")


def main():
    model = sys.argv[1] if len(sys.argv) > 1 else default_model_path()
    llm = llama_cpp.Llama(model_path=model, vocab_only=True, verbose=False)
    out = []
    for text in CASES:
        ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        out.append({"text": text, "ids": ids})
    dest = os.path.join(os.path.dirname(os.path.abspath(__file__)), "smollm2_tokens.json")
    with open(dest, "w", encoding="utf-8") as f:
        # One case per line keeps diffs readable.
        f.write('{"generator": %s,\n "cases": [\n' % json.dumps(f"llama-cpp-python {llama_cpp.__version__}"))
        f.write(",\n".join("  " + json.dumps(c, ensure_ascii=False) for c in out))
        f.write("\n ]\n}\n")
    print(f"wrote {len(out)} cases to {dest}")


if __name__ == "__main__":
    main()
