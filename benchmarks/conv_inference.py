"""Logits of privkit's CNNs on the CPU: channels-last for the call against the default layout.

``attacks.recipe.torch_logits`` and ``privkit.trainers.common.predict_logits`` (every accuracy, every
attack's logits) run a convolutional model in channels-last layout for the call
(:func:`attacks.conv_layout.channels_last_inference`). This script times ``torch_logits`` beside
the same batched loop in the default layout (what it ran before), in one process, repeats
interleaved, on privkit CNNs: the quickstart's (width 8, 1x28x28 digits) and two wider ones
(width 16 on 1x28x28 and on 3x32x32), 4096 inputs each, batches of 1024, one torch thread;
CPU time of this thread, medians; ``ratio`` = default layout / channels-last.

    OMP_NUM_THREADS=1 python benchmarks/conv_inference.py [--json] [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import numpy as np
import torch

from attacks.recipe import torch_logits
from privkit.models import build_model

SCHEMA_VERSION = 1
MODELS = {  # name: (input shape, width)
    "cnn_w8_28x28x1": ((1, 28, 28), 8),
    "cnn_w16_28x28x1": ((1, 28, 28), 16),
    "cnn_w16_32x32x3": ((3, 32, 32), 16),
}


def default_layout_logits(model, x: np.ndarray, batch_size: int = 1024) -> np.ndarray:
    """``torch_logits``'s loop without the layout change (the code before it)."""
    model.eval()
    with torch.no_grad():
        out = [
            model(torch.as_tensor(x[s : s + batch_size], dtype=torch.float32)).float()
            for s in range(0, len(x), batch_size)
        ]
    return torch.cat(out).numpy().astype(np.float64)


def _cpu(fn) -> float:
    start = time.thread_time()
    fn()
    return time.thread_time() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.exit(2, f"--repeats must be >= 1; found {args.repeats}\n")
    torch.set_num_threads(1)
    rows = []
    for name, (shape, width) in MODELS.items():
        torch.manual_seed(0)
        model = build_model("cnn", shape, 10, width=width, feature_dim=32)
        x = np.random.default_rng(0).standard_normal((4096, *shape)).astype(np.float32)
        gap = float(np.abs(torch_logits(model, x) - default_layout_logits(model, x)).max())
        fast, slow = [], []
        for _ in range(args.repeats):
            fast.append(_cpu(lambda m=model, x=x: torch_logits(m, x)))
            slow.append(_cpu(lambda m=model, x=x: default_layout_logits(m, x)))
        rows.append(
            {
                "model": name,
                "channels_last_s": round(statistics.median(fast), 4),
                "default_layout_s": round(statistics.median(slow), 4),
                "ratio": round(statistics.median(s / f for s, f in zip(slow, fast)), 2),
                "max_logit_difference": gap,
            }
        )
    out = {
        "schema_version": SCHEMA_VERSION,
        "benchmark": "conv_inference",
        "torch": torch.__version__,
        "threads": 1,
        "platform": platform.platform(),
        "inputs": 4096,
        "repeats": args.repeats,
        "clock": "thread CPU time",
        "rows": rows,
    }
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        for r in rows:
            print(
                f"{r['model']:18s} channels-last {r['channels_last_s']:.3f} s, default "
                f"{r['default_layout_s']:.3f} s: {r['ratio']:.2f}x (logits within "
                f"{r['max_logit_difference']:.1e})"
            )


if __name__ == "__main__":
    main()
