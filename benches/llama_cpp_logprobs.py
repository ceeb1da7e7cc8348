#!/usr/bin/env python3
"""llama.cpp's prompt log-probabilities behind an OpenAI `/v1/completions` endpoint: the oracle
of `benches/lm_eval_check.py` (issue 29).

Why not a llama.cpp server: `llama-server` refuses `echo` ("Only no echo is supported"), and
`llama-cpp-python[server]` 0.3.36 answers `echo: true, logprobs: 1, max_tokens: 1` with the
prompt's log-probabilities only, leaving out the sampled token's. The OpenAI API returns that
token too, and lm-eval's `local-completions` cuts the last entry off (`token_logprobs[ctxlen:-1]`),
so against that server every one-token continuation scores 0 (measured: 302 of 556 choices, and
an accuracy below chance).

This file is a thin answerer, not a model: llama.cpp evaluates the whole prompt
(`Llama.eval` through llama-cpp-python, `logits_all`, the context reset before each request so
nothing is reused from the previous one), and the answer carries, for every prompt position,
log-softmax of llama.cpp's logits at the position before (`None` for the first token, as OpenAI),
then the greedy next token and its log-probability. No sampling, no temperature: the log-softmax
of the raw logits, which is also pdserve's convention when no penalty is set (docs/api.md).

Only what lm-eval's log-likelihood requests use is served: `prompt` (a string or a list of
strings), `echo`, `logprobs` (top-N, N ≤ 20), `max_tokens` 0 or 1; anything else is a 400.

usage: python llama_cpp_logprobs.py --model GGUF --port N [--alias NAME] [--threads 2]
           [--n-ctx 2048]
(run with the Python of a venv that has llama-cpp-python; lm_eval_check.py does that.)
"""
import argparse
import json
import math
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
import threading

import numpy as np
from llama_cpp import Llama

MAX_TOP = 20


def log_softmax(row):
    row = row.astype(np.float64)
    m = row.max()
    return row - (m + math.log(np.exp(row - m).sum()))


class Oracle:
    def __init__(self, gguf, n_ctx, threads):
        self.llm = Llama(model_path=gguf, n_ctx=n_ctx, n_threads=threads, n_batch=512,
                         logits_all=True, verbose=False)
        self.lock = threading.Lock()

    def answer(self, prompt, top, echo, max_tokens):
        llm = self.llm
        ids = llm.tokenize(prompt.encode(), add_bos=True, special=False)
        if not ids or len(ids) + max_tokens > llm.n_ctx():
            raise ValueError(f"prompt of {len(ids)} tokens does not fit n_ctx {llm.n_ctx()}")
        with self.lock:
            llm.reset()
            llm.eval(ids)
            rows = np.array(llm.scores[: len(ids)], copy=True)
        pieces = [llm.detokenize([t], prev_tokens=ids[:i]).decode("utf-8", "replace")
                  for i, t in enumerate(ids)]
        tokens, logps, tops, offsets = [], [], [], []
        offset = 0

        def entry(piece, logp, lsm):
            nonlocal offset
            tokens.append(piece)
            logps.append(logp)
            offsets.append(offset)
            offset += len(piece)
            if lsm is None:
                tops.append(None)
            else:
                best = np.argsort(-lsm)[:max(top, 1)]
                tops.append({llm.detokenize([int(b)], special=True).decode("utf-8", "replace"):
                             float(lsm[b]) for b in best})

        text = ""
        if echo:
            for i, (t, piece) in enumerate(zip(ids, pieces)):
                lsm = log_softmax(rows[i - 1]) if i > 0 else None
                entry(piece, float(lsm[t]) if lsm is not None else None, lsm)
            text = "".join(pieces)
        if max_tokens >= 1:
            lsm = log_softmax(rows[-1])
            nxt = int(np.argmax(lsm))
            piece = llm.detokenize([nxt], prev_tokens=ids).decode("utf-8", "replace")
            entry(piece, float(lsm[nxt]), lsm)
            text += piece
        return {"text": text, "finish_reason": "length",
                "logprobs": {"tokens": tokens, "token_logprobs": logps,
                             "top_logprobs": tops, "text_offset": offsets}}, len(ids)


def serve(oracle, alias, port):
    class Handler(BaseHTTPRequestHandler):
        def reply(self, code, body):
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/v1/models":
                self.reply(200, {"object": "list", "data": [{"id": alias, "object": "model"}]})
            else:
                self.reply(404, {"error": {"message": f"no route {self.path}"}})

        def do_POST(self):
            if self.path != "/v1/completions":
                return self.reply(404, {"error": {"message": f"no route {self.path}"}})
            try:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                prompts = body["prompt"]
                prompts = [prompts] if isinstance(prompts, str) else prompts
                if not prompts or not all(isinstance(p, str) for p in prompts):
                    raise ValueError("`prompt` must be a string or a list of strings")
                top = int(body.get("logprobs") or 0)
                max_tokens = int(body.get("max_tokens", 1))
                if not 0 <= top <= MAX_TOP or max_tokens not in (0, 1):
                    raise ValueError("`logprobs` must be 0..20 and `max_tokens` 0 or 1")
                choices, used = [], 0
                for i, p in enumerate(prompts):
                    c, n = oracle.answer(p, top, bool(body.get("echo")), max_tokens)
                    choices.append({"index": i, **c})
                    used += n
            except (KeyError, ValueError, TypeError, json.JSONDecodeError) as e:
                return self.reply(400, {"error": {"message": str(e)}})
            self.reply(200, {"object": "text_completion", "model": alias, "choices": choices,
                             "usage": {"prompt_tokens": used, "completion_tokens": max_tokens,
                                       "total_tokens": used + max_tokens}})

        def log_message(self, *args):
            pass

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="GGUF file")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--alias", default="model", help="the model id /v1/models lists")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-ctx", type=int, default=2048)
    args = ap.parse_args()
    serve(Oracle(args.model, args.n_ctx, args.threads), args.alias, args.port)


if __name__ == "__main__":
    main()
