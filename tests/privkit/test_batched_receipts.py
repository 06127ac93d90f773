"""Batched runs record the receipts of the releases they made (issue 31, item 2), as single runs do.

The batched DP-SGD engines (:func:`privkit.batched.many.local_dp_sgd` for DP-FedAvg, FedKADP and
FedKD+DP; :mod:`privkit.batched.many_dpsgd` for dpsgd) keep each model's receipts (one per
release; a release of several models' rows, an audit's reference models, gives each row its own)
and hand every run its clients' receipts, whose composition its ledger records. FedMD-LDP's
batched form shares its knowledge in the single run's own code (its receipts included).

With every binding of the release primitive replaced by a spy (``test_ledger_receipts``):

* seeded, a batched run's ledger is its single run's, and the batched runs' ledgers together hold
  exactly the releases the primitive made, with their sampling rates and noise multipliers;
* a receipt that misstates the noise (the spy's, tampered) is refused by the batched run as by
  the single run where the single run checks its releases against its budget (the federated
  methods), and otherwise lands in the ledger as it does in the single run's (dpsgd, FedMD-LDP):
  the ledger is built from the receipts, never from the configuration;
* an audit's reference runs, whose noise is drawn for all their models in one draw, record each
  model's own receipt of that draw.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch
from test_batched_federations import CASES, _federations
from test_ledger_receipts import _releases_in, _spy_on_the_primitive

from privkit.batched.many import joint_release, train_many
from privkit.data import FederationConfig, build_federation
from privkit.errors import PrivkitError
from privkit.mechanisms.dp_random import DpRandom
from privkit.mechanisms.gaussian import gaussian_release
from privkit.methods import get_trainer
from privkit.trainers import train

METHODS = {
    "dp-fedavg": CASES["dp-fedavg"],
    "fedkadp": CASES["fedkadp"],
    "fedkd-dp": CASES["fedkd-dp"],
    "dpsgd": CASES["dpsgd given-sigma"],
    "fedmd-ldp": CASES["fedmd-ldp"],
}
#: methods whose single run refuses releases other than its budget check admitted
CHECKED = ("dp-fedavg", "fedkadp", "fedkd-dp")
#: methods whose every release touches every client's records (each client's ledger holds it)
POOLED = ("dpsgd",)
SEEDS = [11, 12]


@pytest.fixture(scope="module")
def fed():
    return build_federation(FederationConfig(partition="dirichlet", clients=20, seed=0))


def _made(receipts: list) -> Counter:
    """(sampling rate, noise multiplier) of each release the receipts stand for."""
    return Counter(
        (1.0 if r.sample_rate is None else float(r.sample_rate), float(r.noise_multiplier))
        for r in receipts
        for _ in range(r.releases)
    )


def _recorded(method: str, results: list) -> Counter:
    """The releases the runs' ledgers hold, all runs together (a pooled run's releases once)."""
    total: Counter = Counter()
    for res in results:
        per_client = [
            Counter(r for e in res.ledger.entries(c) for r in _releases_in(e.event))
            for c in res.ledger.clients
        ]
        if method in POOLED:
            assert all(c == per_client[0] for c in per_client)
            total += per_client[0]
        else:
            total += sum(per_client, Counter())
    return total


def _louder(receipt):
    """A receipt claiming half again the noise that was drawn."""
    return dataclasses.replace(receipt, noise_multiplier=1.5 * receipt.noise_multiplier)


def _spied(monkeypatch, method: str, tamper=None) -> list:
    spec = get_trainer(method)
    assert callable(spec.fn) and callable(spec.batched_fn)  # their modules load before the spy
    return _spy_on_the_primitive(monkeypatch, tamper)


@pytest.mark.parametrize("method", list(METHODS))
def test_a_batched_ledger_is_the_single_runs_and_holds_the_releases_made(fed, method, monkeypatch):
    cfg, feds = METHODS[method], _federations(fed, len(SEEDS))
    torch.set_num_threads(1)
    made = _spied(monkeypatch, method)
    alone = [train(method, f, cfg, seed=s) for f, s in zip(feds, SEEDS)]
    assert _made(made) and _recorded(method, alone) == _made(made)
    made.clear()
    many = train_many(method, feds, cfg, SEEDS)
    assert [r.ledger.to_dict() for r in many] == [r.ledger.to_dict() for r in alone]
    # every batched release went through the primitive, and its receipt is in the ledger
    assert _recorded(method, many) == _made(made)


@pytest.mark.parametrize("method", list(METHODS))
def test_a_misstated_receipt_reaches_the_batched_ledger_as_the_single_ones(
    fed, method, monkeypatch
):
    cfg, feds = METHODS[method], _federations(fed, len(SEEDS))
    torch.set_num_threads(1)
    honest = train_many(method, feds, cfg, SEEDS)
    made = _spied(monkeypatch, method, tamper=_louder)
    if method in CHECKED:  # the releases differ from what the budget admitted: refused
        with pytest.raises(PrivkitError, match="the budget admitted"):
            train(method, feds[0], cfg, seed=SEEDS[0])
        with pytest.raises(PrivkitError, match="the budget admitted"):
            train_many(method, feds, cfg, SEEDS)
        return
    alone = [train(method, f, cfg, seed=s) for f, s in zip(feds, SEEDS)]
    made.clear()
    many = train_many(method, feds, cfg, SEEDS)
    assert _recorded(method, many) == _made(made)  # the misstated noise multipliers
    assert [r.ledger.to_dict() for r in many] == [r.ledger.to_dict() for r in alone]
    assert [r.ledger.to_dict() for r in many] != [r.ledger.to_dict() for r in honest]


@pytest.mark.parametrize("method", ["dp-fedavg", "fedkd-dp", "dpsgd"])
def test_reference_runs_drawing_their_noise_together_record_each_models_receipts(
    fed, method, monkeypatch
):
    """An audit's reference runs (seeded, one draw for all their models of a step): each model's
    receipt, at its own sampling rate (the federated clients hold different amounts of data), so
    the reference runs' ledgers are their single runs' (the release-mode target run's too: its
    client sampling is seeded)."""
    cfg = {**METHODS[method], "reproducible_noise": False}
    seeds, feds = [5, 6, 7], _federations(fed, 3)
    torch.set_num_threads(1)
    made = _spied(monkeypatch, method)
    many = train_many(method, feds, cfg, seeds, references=[False, True, True])
    assert [r.reproducible_noise for r in many] == [False, True, True]
    assert _recorded(method, many) == _made(made)
    seeded = {**cfg, "reproducible_noise": True}
    alone = [train(method, f, seeded, seed=s) for f, s in zip(feds, seeds)]
    # the entries (each ledger states its own run's noise mode besides)
    assert [r.ledger.to_dict()["clients"] for r in many] == [
        r.ledger.to_dict()["clients"] for r in alone
    ]


def test_a_joint_release_of_other_dtype_rows_keeps_their_dtype():
    """Rows of unequal rates whose clean sums are float64 are released in float64, from a float64
    draw of the block (as one release of float64 values draws its noise)."""
    gen = torch.Generator().manual_seed(0)
    sums = {"w": torch.randn(4, 2, 3, generator=gen, dtype=torch.float64)}
    noisy, _ = joint_release(
        sums,
        [1, 2],
        std=0.5,
        clip=1.0,
        source=DpRandom(torch.Generator().manual_seed(3)),
        sample_rates=[0.1, 0.2],
    )
    z = torch.randn((2, 6), generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    assert noisy["w"].dtype == torch.float64
    assert torch.equal(noisy["w"].flatten(1), sums["w"][1:3].flatten(1) + 0.5 * z)


@pytest.mark.parametrize("rows", [[0, 2, 3], [1, 2, 3], [2]])
@pytest.mark.parametrize("rates", [[0.1, 0.25, 0.1], [0.2, 0.2, 0.2]])
def test_a_joint_release_is_one_draw_of_the_block_with_a_receipt_per_row(rates, rows):
    """:func:`joint_release` draws the rows' noise as one release of the whole block would, bit for
    bit, and hands each row its receipt at its own sampling rate (rows of unequal rates, each its
    own release; of one rate, one release of all). Rows that are a range are released from
    views of the stacked sums, scattered rows from their copy, one row as one vector: the same
    numbers."""
    gen = torch.Generator().manual_seed(0)
    sums = {"w": torch.randn(5, 3, 7, generator=gen), "b": torch.randn(5, 3, generator=gen)}
    before = {k: v.clone() for k, v in sums.items()}
    rates = rates[: len(rows)]
    noisy, receipts = joint_release(
        sums,
        rows,
        std=0.8,
        clip=0.5,
        source=DpRandom(torch.Generator().manual_seed(1)),
        sample_rates=rates,
    )
    block = torch.cat([sums[k][rows].flatten(1) for k in sorted(sums)], 1)
    whole, receipt = gaussian_release(
        block, std=0.8, sensitivity=0.5, source=DpRandom(torch.Generator().manual_seed(1))
    )
    assert torch.equal(torch.cat([noisy[k].flatten(1) for k in sorted(sums)], 1), whole)
    assert all(torch.equal(sums[k], before[k]) for k in sums)  # the clean sums are left alone
    assert [r.sample_rate for r in receipts] == rates
    assert {(r.noise_multiplier, r.sensitivity, r.releases) for r in receipts} == {
        (receipt.noise_multiplier, receipt.sensitivity, 1)
    }
    with pytest.raises(ValueError, match="one sample rate per row"):
        joint_release(
            sums, rows, std=0.8, clip=0.5, source=DpRandom(gen), sample_rates=rates + [0.1]
        )


def test_rows_that_are_a_range_are_a_slice_and_others_an_index():
    """``rows_of``: rows that form a range index by a slice (views: the reference rows are
    updated in place), any other set by an index tensor of those rows."""
    from privkit.batched.many import rows_of

    cpu = torch.device("cpu")
    assert rows_of([2, 3, 4], cpu) == slice(2, 5)
    assert rows_of([], cpu) == slice(0, 0)
    at = rows_of([1, 3, 4], cpu)
    assert isinstance(at, torch.Tensor) and at.tolist() == [1, 3, 4]
    t = torch.arange(6.0)
    view = t[rows_of([2, 3], cpu)]
    view += 10
    assert t.tolist() == [0.0, 1.0, 12.0, 13.0, 4.0, 5.0]
