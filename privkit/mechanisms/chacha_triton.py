"""The ChaCha20 release stream as one fused GPU kernel (Triton): 53-bit words straight from counters.

:func:`privkit.mechanisms.device_random.chacha20_blocks` computes the block function with torch's
elementwise operations: about 1,100 kernel launches per call, each reading and writing the whole
int64 state. On an H200 that made release noise for ResNet-18's 11.2M parameters cost 43 ms a step
(``benchmarks/dpsgd_step.py --device cuda``), more than the rest of the DP-SGD step. This kernel
computes each block in registers (32-bit words, 20 rounds), adds the input state and writes the
block's eight 53-bit integers, exactly as :meth:`ChaChaStream.bits53
<privkit.mechanisms.device_random.ChaChaStream.bits53>` forms them from the torch path's words: one
launch, 64 bytes written per block, nothing read.

It is used only where it is proved equal to the torch path on this device: :func:`available` runs
the kernel and the torch path (passed in by :mod:`privkit.mechanisms.device_random`) side by side
on test blocks (the RFC 8439 key, counters that carry into the high counter word) the first time
a device asks, and the stream keeps the torch path, with a warning, if Triton is missing, fails
or disagrees. Tests run the kernel in Triton's
interpreter on the CPU where Triton is installed (``TRITON_INTERPRET=1``) and on a GPU in
``benchmarks/run_gpu.sh``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

Reference = Callable[[torch.Tensor, int, int], torch.Tensor]

__all__ = ["available", "bits53"]

_BLOCK = 256  # ChaCha blocks per program: 2,048 words of 53 bits
_checked: dict[str, bool] = {}  # device -> the kernel agrees with the torch path there
_kernel = None


def _build():
    """The Triton kernel (imported lazily: Triton is optional, and the import compiles nothing)."""
    from privkit.mechanisms.chacha_triton_kernel import chacha20_bits53

    return chacha20_bits53


def bits53(key_words: torch.Tensor, counter: int, n: int) -> torch.Tensor:
    """``n`` uniform 53-bit integers (int64) from the ChaCha20 blocks at ``counter``, ``counter +
    1``, ... (key words on the device), by the fused kernel; callers check :func:`available`
    first."""
    global _kernel
    if _kernel is None:
        _kernel = _build()
    dev = key_words.device
    out = torch.empty(n, dtype=torch.int64, device=dev)
    if n == 0:
        return out
    key = key_words.to(torch.int64)  # words below 2**32: exact, cast to uint32 in the kernel
    from attacks.transfers import to_device  # here: the attacks package loads in 1.3 s

    # the first counter, copied queued: a plain copy to the device would wait for every kernel
    # queued before this draw (inside a DP-SGD step, its whole backward pass)
    start = to_device(torch.tensor([counter], dtype=torch.int64), dev)
    blocks = -(-n // 8)
    _kernel[(-(-blocks // _BLOCK),)](out, key, start, n, BLOCK=_BLOCK)
    return out


def _agrees(device: torch.device, reference: Reference) -> bool:
    """Kernel and ``reference`` give the same integers on ``device`` (RFC 8439's key, and counters
    crossing 2**32, where the high counter word starts to count)."""
    key = torch.tensor(
        [int.from_bytes(bytes(range(4 * i, 4 * i + 4)), "little") for i in range(8)],
        dtype=torch.int64,
        device=device,
    )
    for counter, n in ((1, 16), (2**32 - 300, 8 * 700 - 3)):
        if not torch.equal(bits53(key, counter, n), reference(key, counter, n)):
            return False
    return True


def available(device: torch.device, reference: Reference) -> bool:
    """Whether :func:`bits53` runs the fused kernel on ``device``: checked once per device against
    ``reference``, the torch path's ``(key_words, counter, n) -> 53-bit integers``."""
    name = str(device)
    if name not in _checked:
        try:
            _checked[name] = _agrees(device, reference)
            reason = "it disagreed with the torch block function"
        except Exception as e:  # Triton absent, or no backend for this device
            _checked[name], reason = False, f"{type(e).__name__}: {e}"
        if not _checked[name] and device.type == "cuda":
            warnings.warn(
                f"the fused ChaCha20 kernel is not used on {name} ({reason}); release noise "
                "is drawn by torch's elementwise path (same stream, slower)",
                RuntimeWarning,
                stacklevel=3,
            )
    return _checked[name]
