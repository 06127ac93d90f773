"""A DP-SGD step reads nothing back from its device: checked on the CPU.

On a CUDA device an operation that reads a device value to the host (``.item()``, a mask's
count, ``torch.unique``'s size) waits for every kernel queued before it, in the middle of the
step. ``benchmarks/device_waits.py``'s :class:`HostReads` counts such operations on any device;
here the steps of ``dpsgd_step.py``'s models with privkit's GPU forms forced, past their first
steps, make none but the host's own reads of what a queued copy brought back (on a GPU
``test_on_device.py`` checks the same with CUDA's own check)."""

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


def _reads(name: str, noise: str, canaries: int) -> dict:
    if name == "gpt2" and importlib.util.find_spec("transformers") is None:
        pytest.skip("HF transformers is not installed")
    torch.manual_seed(0)
    return device_waits.measure_reads(name, noise, canaries, steps=2, batch=8)


@pytest.mark.parametrize("name", MODELS)
def test_a_dp_sgd_step_reads_nothing_back(name):
    """Embeddings' per-example rows (a token per row, zero rows past the distinct pairs: the
    unique pairs' count was read back), a tied head's rows by example (their largest count was)."""
    out = _reads(name, "seeded", 0)
    assert out["host_reads_per_step"] == 0 and out["host_side_per_step"] == 0, out["sites"]


@pytest.mark.parametrize("name", ["resnet_small", "transformer", "lm"])
def test_a_replayed_step_reads_nothing_back(name):
    """The clipped sum replayed (``StepReplay``): the padding, the key and the recorded
    operations read nothing back once a size is recorded and checked."""
    torch.manual_seed(0)
    out = device_waits.measure_reads(name, "seeded", 0, steps=2, batch=9, replay=True)
    assert out["host_reads_per_step"] == 0 and out["host_side_per_step"] == 0, out["sites"]
    assert out["replayed_steps"] == 2  # the counted steps were replays


@pytest.mark.parametrize("name", ["resnet_small", "lm"])
@pytest.mark.parametrize("noise", ["release", "seeded"])
def test_release_noise_and_canaries_read_only_their_queued_copies(name, noise):
    """The release's draws made ahead and the canaries' joined observation: the host reads only
    what their queued copies brought back (the open draws once a release, the observation)."""
    out = _reads(name, noise, 50)
    assert out["host_reads_per_step"] == 0, out["sites"]
    settle = {"release": 1, "seeded": 0}[noise]
    sites = {site.split(" ")[1] for site in out["sites"]}
    assert sites == ({"settled", "read"} if settle else {"read"})


def test_a_release_drawn_at_once_is_counted(monkeypatch):
    """Without the draws made ahead, a release in its device form finds its open draws where it
    draws them: their count is read back at every release (what the draws ahead took out)."""
    from privkit.mechanisms import grid_noise
    from privkit.mechanisms.dp_random import DpRandom

    monkeypatch.setattr(DpRandom, "grid_ahead", lambda self: None)
    # a GPU's form of the search (the CPU's is numpy's, which no dispatch sees)
    monkeypatch.setattr(
        grid_noise, "_not_below", lambda v, limit: torch.nonzero(~torch.lt(v, limit)).flatten()
    )
    out = _reads("resnet_small", "release", 0)
    assert out["host_reads_per_step"] >= 1
    assert any("grid_noise.py" in site for site in out["sites"])


def test_host_side_sites_are_the_settling_functions_only():
    assert device_waits.host_side("privkit/mechanisms/grid_ahead.py:99 settled")
    assert device_waits.host_side("attacks/whitebox.py:822 read")
    assert not device_waits.host_side("attacks/whitebox.py:822 observe")
    assert not device_waits.host_side("privkit/mechanisms/grid_noise.py:99 settled")


def test_the_gpu_forms_are_undone_after_the_count():
    from attacks import whitebox
    from privkit.mechanisms import ghost_clipping
    from privkit.mechanisms.dp_random import DpRandom

    with device_waits.gpu_forms():
        assert ghost_clipping._offsets_on(torch.device("cpu"))
        assert whitebox.joined_on(torch.device("cpu"))
        assert DpRandom.secret("cpu").grid_ahead() is not None
    assert not ghost_clipping._offsets_on(torch.device("cpu"))
    assert not whitebox.joined_on(torch.device("cpu"))
    assert DpRandom.secret("cpu").grid_ahead() is None
