"""Release-mode noise on the device: ChaCha20 computed by torch (privkit.mechanisms.device_random).

References: RFC 8439's block-function test vector (section 2.3.2) and the all-zero keystream of
its appendix A.1 (test vector #1); the `cryptography` package's ChaCha20 for random keys and
counters; N(0, 1) for the normals (KS, moments, tails, at fixed keys so they cannot flake).
The code is device-agnostic: these tests run it on the CPU; on a GPU the same tests run with
PRIVKIT_TEST_DEVICE=cuda.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from scipy import stats

from privkit.mechanisms.device_random import ChaChaStream, chacha20_blocks
from privkit.mechanisms.dp_random import DpRandom

DEVICE = os.environ.get("PRIVKIT_TEST_DEVICE", "cpu")
RFC_KEY = int.from_bytes(bytes(range(32)), "little")


def _key_words(key: int) -> torch.Tensor:
    return torch.tensor([(key >> (32 * i)) & 0xFFFFFFFF for i in range(8)], dtype=torch.int64)


def test_block_function_matches_rfc8439_section_2_3_2():
    words = torch.tensor(
        [[0x00000001], [0x09000000], [0x4A000000], [0x00000000]], dtype=torch.int64
    )
    out = chacha20_blocks(_key_words(RFC_KEY), words.to(DEVICE))[:, 0].tolist()
    assert [f"{w:08x}" for w in out] == [
        "e4e7f110",
        "15593bd1",
        "1fdd0f50",
        "c47120a3",
        "c7f4d1c7",
        "0368c033",
        "9aaa2204",
        "4e6cd4c3",
        "466482d2",
        "09aa9f07",
        "05d7c214",
        "a2028bd9",
        "d19c12b5",
        "b94e16de",
        "e883d0cb",
        "4e3c50a2",
    ]


def test_zero_key_keystream_matches_rfc8439_appendix_a1():
    stream = ChaChaStream(DEVICE, key=0)
    raw = b"".join(int(w).to_bytes(4, "little") for w in stream.words(1)[:, 0].tolist())
    assert raw.hex() == (
        "76b8e0ada0f13d90405d6ae55386bd28bdd219b8a08ded1aa836efcc8b770dc7"
        "da41597c5157488d7724e03fb8d84a376a43b8f41518a11cc387b669b2ee6586"
    )
    assert stream.counter == 1


def test_keystream_matches_cryptography_for_random_keys_and_counters():
    algorithms = pytest.importorskip("cryptography.hazmat.primitives.ciphers.algorithms")
    from cryptography.hazmat.primitives.ciphers import Cipher

    rng = np.random.default_rng(3)
    for _ in range(5):
        key = int.from_bytes(rng.bytes(32), "little")
        start = int(rng.integers(0, 2**40))
        stream = ChaChaStream(DEVICE, key=key)
        stream.counter = start
        ours = b"".join(
            int(w).to_bytes(4, "little") for w in stream.words(3).t().flatten().tolist()
        )
        # cryptography's 16-byte nonce is state words 12..15: our 64-bit counter, then nonce 0
        nonce = start.to_bytes(8, "little") + bytes(8)
        enc = Cipher(algorithms.ChaCha20(key.to_bytes(32, "little"), nonce), mode=None).encryptor()
        assert ours == enc.update(bytes(3 * 64))


def test_uniforms_are_in_the_open_interval_with_53_bits():
    u = ChaChaStream(DEVICE, key=11).uniform53(100_001)
    assert u.dtype == torch.float64 and len(u) == 100_001
    assert u.min().item() > 0.0 and u.max().item() < 1.0
    assert stats.kstest(u.cpu().numpy(), stats.uniform.cdf).pvalue > 1e-3
    # cells of width 2**-53: the low bits are used (not all uniforms multiples of 2**-32)
    assert ((u.cpu().numpy() * 2.0**32) % 1.0 != 0.5).mean() > 0.99


@pytest.mark.parametrize("key", [1, 2, 3])
def test_normals_have_the_gaussian_statistics_of_the_cpu_stream(key):
    """The statistics tests/privkit/test_dp_random.py applies to the AES stream on the CPU."""
    src = DpRandom(np.random.default_rng(0), DEVICE, normals=ChaChaStream(DEVICE, key=key))
    sigma = 1.7
    noise = sigma * src.randn(300, 400)
    assert noise.device.type == torch.device(DEVICE).type and noise.dtype == torch.float32
    z = noise.flatten().double().cpu().numpy()
    assert stats.kstest(z / sigma, stats.norm.cdf).pvalue > 1e-3
    n = len(z)
    assert abs(z.mean()) < 5 * sigma / np.sqrt(n)
    assert abs(z.var() - sigma**2) < 5 * sigma**2 * np.sqrt(2 / n)
    z64 = src.randn(200_000, dtype=torch.float64).cpu().numpy()
    assert stats.kstest(z64, stats.norm.cdf).pvalue > 1e-3
    # tails: the count beyond 3 sd is Binomial(n, 2 * Phi(-3)); within 5 of its sds
    p = 2 * stats.norm.sf(3.0)
    assert abs((np.abs(z64) > 3).sum() - len(z64) * p) < 5 * np.sqrt(len(z64) * p)
    # consecutive draws are uncorrelated (lag-1 correlation within 5 standard errors)
    assert abs(np.corrcoef(z64[:-1], z64[1:])[0, 1]) < 5 / np.sqrt(len(z64))
    into = torch.empty(2, 3, device=DEVICE)
    assert src.randn(2, 3, out=into) is into and torch.isfinite(into).all()


def test_release_mode_on_an_accelerator_draws_on_the_device_from_fresh_keys():
    a = DpRandom.secret(DEVICE, on_device=True)
    b = DpRandom.secret(DEVICE, on_device=True)
    assert isinstance(a.normals, ChaChaStream) and not a.seeded_torch
    assert not torch.equal(a.randn(64), b.randn(64))
    assert DpRandom.secret("cpu").normals is None  # the CPU keeps its AES stream
    # sampling stays on the AES stream
    assert a.mask(10, rate=0.5).dtype == torch.bool
    with pytest.raises(ValueError, match="normals"):
        DpRandom(torch.Generator(), normals=ChaChaStream("cpu", key=1))


def test_stream_advances_and_rejects_bad_keys():
    s = ChaChaStream(DEVICE, key=5)
    first, second = s.normal(10), s.normal(10)
    assert not torch.equal(first, second) and s.counter == 4
    with pytest.raises(ValueError, match="key"):
        ChaChaStream("cpu", key=2**256)
    with pytest.raises(ValueError, match="n_blocks"):
        s.words(-1)


_FUSED_CHECK = """
import secrets, torch
from privkit.mechanisms import chacha_triton
from privkit.mechanisms.device_random import torch_bits53
dev = torch.device({device!r})
assert chacha_triton.available(dev, torch_bits53)
for counter, n in ((0, 1), (7, 9), (2**32 - 5, 8 * 40 + 3), (secrets.randbits(62), 5000)):
    key = torch.tensor([secrets.randbits(32) for _ in range(8)], dtype=torch.int64, device=dev)
    fused = chacha_triton.bits53(key, counter, n)
    assert torch.equal(fused, torch_bits53(key, counter, n)), (counter, n)
print("equal")
"""


def test_the_fused_kernel_gives_the_torch_paths_integers():
    """The Triton kernel against the torch block function (itself pinned to RFC 8439 and the
    cryptography package above): random keys, counters that carry into the high word, lengths
    that end inside a block. On a GPU it runs compiled; on a CPU with Triton installed, in
    Triton's interpreter (a fresh process: the interpreter is chosen at import)."""
    if DEVICE.startswith("cuda"):
        exec(_FUSED_CHECK.format(device=DEVICE), {})
        s = ChaChaStream(DEVICE, key=RFC_KEY)
        assert s._fused()  # the stream on a GPU takes the kernel, and equals the CPU's stream
        cpu = ChaChaStream("cpu", key=RFC_KEY)
        assert torch.equal(s.bits53(1001).cpu(), cpu.bits53(1001)) and s.counter == cpu.counter
        return
    pytest.importorskip("triton")
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run(
        [sys.executable, "-c", _FUSED_CHECK.format(device="cpu")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == 0 and "equal" in r.stdout, r.stderr[-2000:]


def test_a_kernel_that_disagrees_or_fails_is_not_used(monkeypatch):
    """The torch path stays the stream's definition: a fused kernel that gives other integers (or
    cannot run) is refused, with a warning on a GPU, and the stream draws by torch."""
    from privkit.mechanisms import chacha_triton
    from privkit.mechanisms.device_random import torch_bits53

    def wrong(key, counter, n):
        return torch_bits53(key, counter, n) ^ 1

    monkeypatch.setattr(chacha_triton, "bits53", wrong)
    monkeypatch.setattr(chacha_triton, "_checked", {})
    assert not chacha_triton.available(torch.device("cpu"), torch_bits53)
    monkeypatch.setattr(chacha_triton, "_checked", {})
    with pytest.warns(RuntimeWarning, match="disagreed|Error"):  # this machine may lack a GPU
        assert not chacha_triton.available(torch.device("cuda:0"), torch_bits53)
    stream = ChaChaStream("cpu", key=RFC_KEY)
    assert not stream._fused()
    assert torch.equal(stream.bits53(16), ChaChaStream("cpu", key=RFC_KEY).bits53(16))
