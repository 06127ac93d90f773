"""Release-mode DP noise drawn where the model lives: a ChaCha20 stream computed by torch on the device.

On a GPU, drawing noise on the CPU (:mod:`privkit.mechanisms.dp_random`'s AES stream) and copying it over
costs a host round trip per block of steps and ties the GPU to one CPU thread's generator. This
module computes the ChaCha20 keystream (Bernstein 2008; the block function of RFC 8439) with torch
integer operations on whatever device its tensors live on: a counter-based generator, each 64-byte
block a pure function of (key, counter), so any number of blocks are computed in parallel and the
stream never leaves the device. The 256-bit key comes from the operating system's CSPRNG
(``secrets``), fresh for every stream and never stored; ChaCha20 is a stream cipher whose output
reveals nothing of the key (unlike torch's Philox, whose counter and key a few outputs give away).

Normals come from pairs of 53-bit uniforms by the Box-Muller transform in float64 (both the cosine
and the sine), then cast to the requested type: the smallest uniform is 2**-53, so the noise reaches
8.5 standard deviations; a Gaussian puts 1.6e-17 of its mass beyond that, below any delta privkit
accounts for.

The arithmetic is device-agnostic (int64 tensors holding 32-bit words), so the CPU runs the same code
in tests (the RFC 8439 test vector, the normals' statistics); speed on a GPU is in
``benchmarks/dp_random_throughput.py --device cuda``.
"""

from __future__ import annotations

import math
import secrets

import torch

from privkit.mechanisms import chacha_triton

__all__ = ["ChaChaStream", "chacha20_blocks", "torch_bits53"]

_MASK = 0xFFFFFFFF
# "expand 32-byte k", the ChaCha constants (RFC 8439, section 2.3)
_CONSTANTS = (0x61707865, 0x3320646E, 0x79622D32, 0x6B206574)
_TWO_POW_53 = float(2**53)


def _rotl(x: torch.Tensor, n: int) -> torch.Tensor:
    return ((x << n) | (x >> (32 - n))) & _MASK


def _quarter_rounds(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, d: torch.Tensor) -> None:
    """Four ChaCha quarter rounds at once, in place: row i of ``a, b, c, d`` is one quarter round's
    (a, b, c, d) for every block (RFC 8439, section 2.1)."""
    a.add_(b).bitwise_and_(_MASK)
    d.copy_(_rotl(d ^ a, 16))
    c.add_(d).bitwise_and_(_MASK)
    b.copy_(_rotl(b ^ c, 12))
    a.add_(b).bitwise_and_(_MASK)
    d.copy_(_rotl(d ^ a, 8))
    c.add_(d).bitwise_and_(_MASK)
    b.copy_(_rotl(b ^ c, 7))


def chacha20_blocks(key_words: torch.Tensor, words12_15: torch.Tensor) -> torch.Tensor:
    """ChaCha20 block function for many blocks: ``(16, n)`` int64 tensor of 32-bit output words.

    ``key_words``: the eight 32-bit key words (little-endian, as RFC 8439 reads the key bytes);
    ``words12_15``: ``(4, n)``, each block's state words 12 to 15 (counter and nonce).
    """
    n = words12_15.shape[1]
    dev = words12_15.device
    init = torch.empty(16, n, dtype=torch.int64, device=dev)
    from attacks.transfers import to_device  # here: the attacks package loads in 1.3 s

    # copied queued: a plain copy to a GPU would wait for every kernel queued before the draw
    init[:4] = to_device(torch.tensor(_CONSTANTS, dtype=torch.int64), dev).unsqueeze(1)
    init[4:12] = key_words.to(device=dev, dtype=torch.int64).unsqueeze(1)
    init[12:] = words12_15
    s = init.clone()
    rows = s.view(4, 4, n)  # rows[0] = words 0..3 (a), rows[1] = 4..7 (b), rows[2] = c, rows[3] = d
    for _ in range(10):
        # column round: quarter rounds on (0,4,8,12), (1,5,9,13), ... : the four rows as they are
        _quarter_rounds(rows[0], rows[1], rows[2], rows[3])
        # diagonal round: (0,5,10,15), (1,6,11,12), ... : rows b, c, d turned by 1, 2, 3 places
        b, c, d = rows[1].roll(-1, 0), rows[2].roll(-2, 0), rows[3].roll(-3, 0)
        _quarter_rounds(rows[0], b, c, d)
        rows[1].copy_(b.roll(1, 0))
        rows[2].copy_(c.roll(2, 0))
        rows[3].copy_(d.roll(3, 0))
    return (s + init) & _MASK


def torch_bits53(key_words: torch.Tensor, counter: int, n: int) -> torch.Tensor:
    """``n`` uniform 53-bit integers (int64) from the blocks at ``counter``, ``counter + 1``, ...:
    draw ``j`` of a block is ``(w[2j] << 21) | (w[2j + 1] >> 11)`` (32 + 21 bits)."""
    w = _keystream(key_words, counter, -(-n // 8)).t().reshape(-1, 2)[:n]  # 8 draws a block
    return (w[:, 0] << 21) | (w[:, 1] >> 11)


def _keystream(key_words: torch.Tensor, counter: int, n_blocks: int) -> torch.Tensor:
    """The blocks at ``counter``, ``counter + 1``, ... (nonce 0): ``(16, n_blocks)`` words."""
    ctr = torch.arange(counter, counter + n_blocks, dtype=torch.int64, device=key_words.device)
    state = torch.zeros(4, n_blocks, dtype=torch.int64, device=key_words.device)
    state[0], state[1] = ctr & _MASK, ctr >> 32
    return chacha20_blocks(key_words, state)


class ChaChaStream:
    """A ChaCha20 keystream on ``device``, read block by block (64-bit counter, 64-bit nonce 0).

    Parameters
    ----------
    device : torch.device or str
        Where the keystream and everything drawn from it are computed.
    key : int, optional
        256-bit key; ``None`` (release mode) takes it from ``secrets``. A fixed key is for tests
        of the stream itself, never for release.
    """

    def __init__(self, device: str | torch.device = "cpu", key: int | None = None):
        if key is None:
            key = secrets.randbits(256)
        if not 0 <= int(key) < 2**256:
            raise ValueError(f"key must be in [0, 2**256); found {key}")
        self.device = torch.device(device)
        words = [(int(key) >> (32 * i)) & _MASK for i in range(8)]
        self._key = torch.tensor(words, dtype=torch.int64, device=self.device)
        self.counter = 0  # blocks used so far

    def _advance(self, n_blocks: int) -> int:
        """Reserve the next ``n_blocks`` blocks; returns the first one's counter."""
        if n_blocks < 0:
            raise ValueError(f"n_blocks must be >= 0; found {n_blocks}")
        # counters are int64 on the device: 2**63 blocks (5e20 bytes) is the stream's end
        if self.counter + n_blocks >= 2**63:
            raise OverflowError("ChaCha20 stream exhausted (2**63 blocks); start a new stream")
        self.counter += n_blocks
        return self.counter - n_blocks

    def _fused(self) -> bool:
        return self.device.type == "cuda" and chacha_triton.available(self.device, torch_bits53)

    def words(self, n_blocks: int) -> torch.Tensor:
        """The next ``n_blocks`` blocks' output words, ``(16, n_blocks)`` int64 in [0, 2**32)."""
        return _keystream(self._key, self._advance(n_blocks), n_blocks)

    def bits53(self, n: int) -> torch.Tensor:
        """``n`` independent uniform integers in ``[0, 2**53)`` (int64; two 32-bit words each).

        On a GPU where :mod:`privkit.mechanisms.chacha_triton` proved its fused kernel equal to
        this class's torch path, the kernel computes them (the same integers, one launch)."""
        blocks = -(-n // 8)  # 8 draws per 16-word block
        start = self._advance(blocks)
        if self._fused():
            return chacha_triton.bits53(self._key, start, n)
        return torch_bits53(self._key, start, n)

    def uniform53(self, n: int) -> torch.Tensor:
        """``n`` uniforms on (0, 1) in float64: 53 random bits each, centred in their cells so that
        neither 0 nor 1 occurs."""
        bits = self.bits53(n)
        return (bits.to(torch.float64) + 0.5) / _TWO_POW_53

    def normal(self, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``n`` standard normals (Box-Muller in float64, cast to ``dtype``)."""
        pairs = -(-n // 2)
        u = self.uniform53(2 * pairs).view(2, pairs)
        r = torch.sqrt(-2.0 * torch.log(u[0]))
        angle = (2.0 * math.pi) * u[1]
        z = torch.cat([r * torch.cos(angle), r * torch.sin(angle)])[:n]
        return z.to(dtype)
