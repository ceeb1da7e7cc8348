#!/usr/bin/env python3
"""llama.cpp on the same GGUF, measured the way `pdserve bench model` measures pdserve.

Needs the PyPI package llama-cpp-python (built with AMX off on this VM, see docs/benchmarks.md).
Prints one JSON object with the same keys as `pdserve bench model --json` (decode_tps_b8 is
null: the Python binding has no batched decode).

usage: llamacpp_reference.py GGUF THREADS
"""
import json
import statistics
import sys
import time

from llama_cpp import Llama


def main():
    path, threads = sys.argv[1], int(sys.argv[2])
    llm = Llama(model_path=path, n_ctx=1024, n_batch=512, n_threads=threads,
                n_threads_batch=threads, verbose=False)
    vocab = llm.n_vocab()

    def prompt(n, salt=0):
        return [((i * 7919 + salt * 104729 + 13) % vocab) for i in range(n)]

    def prefill(n):
        toks = prompt(n)
        llm.reset(); llm.eval(toks)  # warm-up
        times = []
        for _ in range(3):
            llm.reset()
            t = time.perf_counter(); llm.eval(toks); times.append(time.perf_counter() - t)
        return n / statistics.median(times)

    def decode(steps=64):
        llm.reset(); llm.eval(prompt(1, 1))
        t = time.perf_counter()
        for _ in range(steps):
            tok = int(llm.scores[llm.n_tokens - 1].argmax())
            llm.eval([tok])
        return steps / (time.perf_counter() - t)

    out = {"model": path.rsplit("/", 1)[-1], "threads": threads, "engine": "llama.cpp",
           "prefill_tps_128": prefill(128), "prefill_tps_512": prefill(512),
           "decode_tps_b1": decode(), "decode_tps_b8": None}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
