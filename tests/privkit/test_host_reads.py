"""A DP-SGD step reads nothing back from its device: checked on the CPU.

On a CUDA device an operation that reads a device value to the host (``.item()``, a mask's
count, ``torch.unique``'s size) waits for every kernel queued before it, in the middle of the
step. ``benchmarks/device_waits.py``'s :class:`HostReads` counts such operations on any device;
here the steps of ``dpsgd_step.py``'s models, with privkit's GPU forms and seeded noise, past their
first steps, make none (on a GPU ``test_on_device.py`` checks it with CUDA's own check)."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))
import device_waits  # noqa: E402  (the benchmarks folder, as the script runs)


@pytest.mark.parametrize(
    "read",
    [
        lambda t: t.sum().item(),
        lambda t: int(t.max()),
        lambda t: bool(t.any()),
        lambda t: torch.nonzero(t > 0),
        lambda t: torch.unique(t),
        lambda t: torch.unique(t, return_inverse=True),
        lambda t: t[t > 0],
        lambda t: t.masked_fill(t > 0, 0)[t < 0],
        lambda t: t.index_put_((t > 0,), torch.tensor(0.0)),
        lambda t: torch.bincount(t.long().abs()),
        lambda t: torch.repeat_interleave(t.long().abs()),
        lambda t: torch.equal(t, t),
    ],
)
def test_a_read_back_is_counted_once_at_its_site(read):
    t = torch.randn(16)
    with device_waits.HostReads() as reads:
        read(t)
    assert sum(reads.sites.values()) >= 1
    assert set(reads.sites) == {"outside privkit"}  # made here, in a test


@pytest.mark.parametrize(
    "work",
    [
        lambda t: torch.sort(t),
        lambda t: t.cumsum(0),
        lambda t: torch.zeros(16).index_add_(0, torch.arange(16), t),
        lambda t: t[torch.arange(4)],
        lambda t: torch.where(t > 0, t, 0.0),
        lambda t: torch.zeros(16).scatter_(0, torch.arange(16), t),
        lambda t: t.max(),
    ],
)
def test_work_that_stays_on_the_device_is_not_counted(work):
    t = torch.randn(16)
    with device_waits.HostReads() as reads:
        work(t)
    assert not reads.sites


MODELS = ["resnet_small", "transformer", "encoder", "vit", "lm", "lstm", "gpt2"]


@pytest.mark.parametrize("name", MODELS)
def test_a_dp_sgd_step_reads_nothing_back(name):
    """Embeddings' per-example rows (a token per row, zero rows past the distinct pairs: the
    unique pairs' count was read back), a tied head's rows by example (their largest count was)."""
    if name == "gpt2" and importlib.util.find_spec("transformers") is None:
        pytest.skip("HF transformers is not installed")
    torch.manual_seed(0)
    out = device_waits.measure_reads(name, steps=2, batch=8)
    assert out["host_reads_per_step"] == 0, out["sites"]


def test_the_gpu_forms_are_undone_after_the_count():
    from privkit.mechanisms import ghost_clipping

    with device_waits.gpu_forms():
        assert ghost_clipping._offsets_on(torch.device("cpu"))
    assert not ghost_clipping._offsets_on(torch.device("cpu"))
