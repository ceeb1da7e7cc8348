"""HF transformers on the same weights as `pdserve cuda verify --model DIR` (an HF checkpoint
directory), on the GPU: greedy tokens from the prompt ids that verify recorded, compared with
pdserve's GPU tokens, and prefill / decode tokens/s at batch 1 and 32 (f16, KV cache on).

    python3 benches/cuda_hf_reference.py HF_DIR VERIFY_JSON > hf.json

Run by benches/device_check.sh on a machine with PyTorch, transformers and a GPU.
"""
import json
import sys
import time

import torch
from transformers import AutoModelForCausalLM


def load(path):
    try:
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float16)
    except TypeError:  # transformers < 4.56 spells it torch_dtype
        return AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float16)


def timed(fn):
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t


@torch.inference_mode()
def greedy(model, ids, n):
    x = torch.tensor([ids], device="cuda")
    out = model(input_ids=x, use_cache=True)
    past, toks = out.past_key_values, []
    nxt = out.logits[0, -1].argmax().item()
    for _ in range(n):
        toks.append(nxt)
        out = model(input_ids=torch.tensor([[nxt]], device="cuda"), past_key_values=past,
                    use_cache=True)
        past = out.past_key_values
        nxt = out.logits[0, -1].argmax().item()
    return toks


@torch.inference_mode()
def prefill_tps(model, n, vocab):
    x = torch.randint(0, vocab, (1, n), device="cuda")
    model(input_ids=x)
    times = [timed(lambda: model(input_ids=x))[1] for _ in range(3)]
    return n / sorted(times)[1]


@torch.inference_mode()
def decode_tps(model, batch, steps, vocab):
    x = torch.randint(0, vocab, (batch, 1), device="cuda")
    out = model(input_ids=x, use_cache=True)
    past = out.past_key_values

    def run():
        nonlocal past
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(steps):
            o = model(input_ids=nxt, past_key_values=past, use_cache=True)
            past = o.past_key_values
            nxt = o.logits[:, -1].argmax(-1, keepdim=True)

    return batch * steps / timed(run)[1]


def main():
    path, verify = sys.argv[1], json.load(open(sys.argv[2]))
    model = load(path).to("cuda").eval()
    vocab = model.config.vocab_size
    cases = []
    for g in verify["greedy"]:
        toks = greedy(model, g["prompt_ids"], len(g["gpu"]))
        same = 0
        while same < len(toks) and same < len(g["gpu"]) and toks[same] == g["gpu"][same]:
            same += 1
        cases.append({"prompt_tokens": len(g["prompt_ids"]), "hf": toks,
                      "matched_pdserve_gpu": same})
    speed = {
        "prefill_tps_128": prefill_tps(model, 128, vocab),
        "prefill_tps_512": prefill_tps(model, 512, vocab),
        "prefill_tps_2048": prefill_tps(model, 2048, vocab),
        "decode_tps_b1": decode_tps(model, 1, 64, vocab),
        "decode_tps_b32": decode_tps(model, 32, 64, vocab),
    }
    print(json.dumps({"torch": torch.__version__, "device": torch.cuda.get_device_name(),
                      "greedy": cases, "speed": speed}))


if __name__ == "__main__":
    main()
