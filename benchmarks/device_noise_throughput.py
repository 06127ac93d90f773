"""Release-mode normals on an accelerator: the device's ChaCha20 stream against the alternatives.

In one run on ``--device`` (best of ``--repeats``), the time for ``--n`` (default 10M) float32
standard normals from:

* ``torch_s``: torch's own generator on the device (Philox on CUDA; seeded, not secret: the
  reproducible-mode stream, the speed to beat);
* ``chacha_s``: privkit's release stream on the device (:class:`privkit.mechanisms.device_random.ChaChaStream`,
  what ``DpRandom.secret("cuda")`` draws from: on a GPU the fused Triton kernel of
  :mod:`privkit.mechanisms.chacha_triton` where it is available, ``chacha_fused``), and
  ``chacha_torch_path_s`` the same stream by torch's elementwise operations;
* ``aes_copy_s``: privkit's CPU release stream (AES-CTR + numpy's ziggurat) and the copy to the
  device: what release mode cost on a GPU before the device stream;
* ``grid_s``: what release mode draws for its noise (:mod:`privkit.mechanisms.grid_noise`: the exact
  rounded-Gaussian integers of the release grid, from the ChaCha stream on the device), and
  ``grid_release_s`` the whole release of ``--n`` coordinates (draws and snapping) beside
  ``torch_release_s``, ``x + z`` with torch's generator.

Ratios are against ``torch_s``. Without a GPU, ``--device cpu`` measures the same code on the CPU
(the ChaCha stream is then slower than the AES stream, which is why the CPU keeps AES).

    python benchmarks/device_noise_throughput.py --device cuda --json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from privkit.mechanisms.device_random import ChaChaStream
from privkit.mechanisms.dp_random import DpRandom


def best_of(fn, repeats: int, sync) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return min(times)


def _compiled(args, dev, sync) -> dict:
    """The stream with its block function compiled (``torch.compile``): time, and equality of the
    words with the eager function's at the same key."""
    from privkit.mechanisms import device_random

    eager = device_random.chacha20_blocks
    try:
        device_random.chacha20_blocks = torch.compile(eager, dynamic=True)
        start = time.perf_counter()
        same = torch.equal(
            device_random.ChaChaStream(dev, key=7).words(1000),
            eager(
                device_random.ChaChaStream(dev, key=7)._key,
                torch.stack(
                    [torch.arange(1000, device=dev)]
                    + [torch.zeros(1000, dtype=torch.int64, device=dev)] * 3
                ),
            ),
        )
        compile_s = time.perf_counter() - start
        stream = device_random.ChaChaStream(dev)
        return {
            "chacha_compiled_s": best_of(lambda: stream.normal(args.n), args.repeats, sync),
            "chacha_compiled_equal": bool(same),
            "compile_s": compile_s,
        }
    except Exception as err:  # the compiler is optional: say why it did not run
        return {"chacha_compiled_error": f"{type(err).__name__}: {err}"[:300]}
    finally:
        device_random.chacha20_blocks = eager


def _grid(args, dev, sync, seeded) -> dict:
    """Release mode's noise on the grid (privkit.mechanisms.grid_noise), beside torch's ``x + z``."""
    from privkit.mechanisms import gaussian_release
    from privkit.mechanisms.grid_noise import Grid, WordBits, rounded_gaussian

    grid, bits = Grid.for_release(1.0, 1.0, args.n), WordBits(ChaChaStream(dev))
    secret = DpRandom.secret(dev, on_device=True)
    clean = {"w": torch.randn(args.n, device=dev)}
    return {
        "grid_s": best_of(lambda: rounded_gaussian(grid.scale, args.n, bits), args.repeats, sync),
        "grid_release_s": best_of(
            lambda: gaussian_release(clean, std=1.0, sensitivity=1.0, source=secret)[0],
            args.repeats,
            sync,
        ),
        "torch_release_s": best_of(
            lambda: gaussian_release(clean, std=1.0, sensitivity=1.0, source=seeded)[0],
            args.repeats,
            sync,
        ),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--n", type=int, default=10_000_000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--compile",
        action="store_true",
        help="also time the block function compiled by torch.compile (one fused kernel)",
    )
    args = ap.parse_args()
    if args.device != "cpu" and not (args.device.startswith("cuda") and torch.cuda.is_available()):
        raise SystemExit(f"--device must be cpu or an available cuda device; found {args.device!r}")
    if args.n < 1 or args.repeats < 1:
        raise SystemExit(f"--n and --repeats must be >= 1; found {args.n} and {args.repeats}")
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    torch.set_num_threads(1)
    seeded = torch.Generator(device=dev).manual_seed(1)
    chacha = ChaChaStream(dev)
    torch_path = ChaChaStream(dev)
    torch_path._fused = lambda: False  # the elementwise torch path the fused kernel replaced
    aes = DpRandom.secret(dev, on_device=False)
    res = {
        "torch_s": best_of(
            lambda: torch.randn(args.n, generator=seeded, device=dev), args.repeats, sync
        ),
        "chacha_s": best_of(lambda: chacha.normal(args.n), args.repeats, sync),
        "chacha_fused": chacha._fused(),
        "chacha_torch_path_s": best_of(lambda: torch_path.normal(args.n), args.repeats, sync),
        "aes_copy_s": best_of(lambda: aes.randn(args.n), args.repeats, sync),
        **_grid(args, dev, sync, seeded),
    }
    if args.compile:
        res.update(_compiled(args, dev, sync))
    res["chacha_ratio"] = res["chacha_s"] / res["torch_s"]
    res["grid_ratio"] = res["grid_s"] / res["torch_s"]
    res["grid_release_ratio"] = res["grid_release_s"] / res["torch_release_s"]
    res["aes_copy_ratio"] = res["aes_copy_s"] / res["torch_s"]
    res.update(
        n=args.n,
        device=str(dev),
        repeats=args.repeats,
        torch=torch.__version__,
        device_name=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
    )
    if args.json:
        print(json.dumps(res, indent=1))
        return
    print(
        f"{args.n:,} float32 normals on {res['device_name']}: torch {res['torch_s']:.4f} s, "
        f"ChaCha20 on the device {res['chacha_s']:.4f} s ({res['chacha_ratio']:.1f}x), "
        f"AES on the CPU + copy {res['aes_copy_s']:.4f} s ({res['aes_copy_ratio']:.1f}x)"
    )


if __name__ == "__main__":
    main()
