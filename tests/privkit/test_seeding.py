"""privkit.seeding.seed_torch: the global generators' state as torch.manual_seed leaves it."""

import pytest
import torch

from privkit import seeding


@pytest.mark.parametrize("seed", [0, 7, 2**64 + 3, -5])
def test_seed_torch_draws_as_manual_seed(seed):
    seeding.seed_torch(seed)
    got = (torch.rand(4), torch.randn(3), torch.randint(0, 100, (5,)))
    torch.manual_seed(int(seed) % (2**63))
    want = (torch.rand(4), torch.randn(3), torch.randint(0, 100, (5,)))
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_seed_torch_seeds_every_generator_where_an_accelerator_is_there(monkeypatch):
    """With an accelerator available the accelerators' generators are seeded too
    (torch.manual_seed); without one only the CPU's, and no CUDA seeding is queued."""
    calls = []
    monkeypatch.setattr(torch, "manual_seed", lambda s: calls.append(s))
    monkeypatch.setattr(seeding, "_accelerator_available", lambda: True)
    seeding.seed_torch(11)
    assert calls == [11]
    monkeypatch.setattr(seeding, "_accelerator_available", lambda: False)
    queued = len(torch.cuda._queued_calls)
    seeding.seed_torch(12)
    assert calls == [11] and len(torch.cuda._queued_calls) == queued
    assert torch.default_generator.initial_seed() == 12
