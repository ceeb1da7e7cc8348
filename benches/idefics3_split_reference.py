#!/usr/bin/env python3
"""Records transformers' Idefics3 / SmolVLM image splitting for a handful of image sizes.

Writes gpu/tests/data/idefics3_split.json, which gpu/tests/vision.rs compares pdserve's
splitting against (so CI needs no Python transformers). For each case: the splitting settings
(`size.longest_edge`, `max_image_size.longest_edge`), the image's width and height, the sizes
after the two resizes of `Idefics3ImageProcessor` (longest edge to `size.longest_edge`, then
each side up to a multiple of `max_image_size`), the tile grid (`rows`, `cols`: 0 and 0 for an
image that is not split), every sub-image's per-channel mean of the normalized pixels (tiles
row-major, then the global image) and the processor's prompt text for the image
(`Idefics3Processor.replace_image_token`, checked equal to SmolVLM's, with an `image_seq_len` of 2).

The image of `w`×`h` is the gradient `r = 255·x/(w-1)`, `g = 255·y/(h-1)`,
`b = 255·(x+y)/(w+h-2)` (integer division; 0 for a side of 1), which the Rust test builds too.

Usage (no torch needed: the PIL image processor):
    python3 -m pip install --target /tmp/tfsplit transformers pillow numpy
    PYTHONPATH=/tmp/tfsplit python3 benches/idefics3_split_reference.py
"""

import json
import os

import numpy as np
import transformers
from types import SimpleNamespace

from transformers.image_utils import SizeDict
from transformers.models.idefics3.processing_idefics3 import Idefics3Processor
from transformers.models.smolvlm import processing_smolvlm
from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

SEQ_LEN = 2
# (size.longest_edge, max_image_size.longest_edge): SmolVLM-256M/500M, SmolVLM-Instruct,
# the synthetic test model's, and one that never cuts an image.
SETTINGS = [(2048, 512), (1536, 384), (64, 32), (512, 512)]
SIZES = [(300, 200), (512, 512), (1000, 700), (2048, 1536), (20, 3000), (64, 48), (513, 100), (31, 33)]


def gradient(w, h):
    x = np.arange(w, dtype=np.int64)[None, :].repeat(h, 0)
    y = np.arange(h, dtype=np.int64)[:, None].repeat(w, 1)
    r = 255 * x // max(w - 1, 1)
    g = 255 * y // max(h - 1, 1)
    b = 255 * (x + y) // max(w + h - 2, 1)
    return np.stack([r, g, b], -1).astype(np.uint8)


def main():
    cases = []
    for longest, tile in SETTINGS:
        proc = Idefics3ImageProcessorPil(
            do_image_splitting=True,
            size={"longest_edge": longest},
            max_image_size={"longest_edge": tile},
            image_mean=[0.5, 0.5, 0.5],
            image_std=[0.5, 0.5, 0.5],
            do_pad=False,
        )
        for w, h in SIZES:
            img = gradient(w, h)
            chw = np.ascontiguousarray(img.transpose(2, 0, 1))
            step1 = proc.resize(chw, SizeDict(longest_edge=longest))
            step2 = proc.resize_for_vision_encoder(step1, tile)
            out = proc.preprocess([[img]], return_row_col_info=True)
            frames = out["pixel_values"][0]
            rows, cols = out["rows"][0][0], out["cols"][0][0]
            # Idefics3Processor's expansion of one image (it needs only these attributes) ...
            names = SimpleNamespace(
                fake_image_token="<fake_token_around_image>",
                global_image_tag="<global-img>",
                image_token="<image>",
                image_seq_len=SEQ_LEN,
            )
            prompt = Idefics3Processor.replace_image_token(names, {"rows": [[rows]], "cols": [[cols]]}, 0)
            # ... is SmolVLMProcessor's.
            assert prompt == processing_smolvlm.get_image_prompt_string(
                rows, cols, SEQ_LEN, "<fake_token_around_image>", "<image>", "<global-img>"
            )
            cases.append(
                {
                    "longest_edge": longest,
                    "tile": tile,
                    "width": w,
                    "height": h,
                    "resized": [int(step1.shape[2]), int(step1.shape[1])],
                    "tiled": [int(step2.shape[2]), int(step2.shape[1])],
                    "rows": int(rows),
                    "cols": int(cols),
                    "frames": [[int(f.shape[2]), int(f.shape[1])] for f in frames],
                    "means": [[round(float(f[c].mean()), 5) for c in range(3)] for f in frames],
                    "prompt": prompt,
                }
            )
    path = os.path.join(os.path.dirname(__file__), "..", "gpu", "tests", "data", "idefics3_split.json")
    with open(path, "w") as f:
        json.dump({"transformers": transformers.__version__, "seq_len": SEQ_LEN, "cases": cases}, f, indent=1)
        f.write("\n")
    print(f"wrote {len(cases)} cases to {path}")


if __name__ == "__main__":
    main()
