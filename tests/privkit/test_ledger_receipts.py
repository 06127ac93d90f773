"""Every method with a formal guarantee: its ledger holds exactly the Gaussian releases it made
(issue 31, item 2), counted and with their parameters.

Each method trains once (small settings) with every binding of the release primitive
(:func:`privkit.mechanisms.gaussian_release`) in privkit's loaded modules replaced by a spy that
keeps each receipt. The ledger must then hold the same releases: the same (sampling rate, noise
multiplier) pairs, each as many times. A release touches either every client's records (pooled
training: dpsgd; client-level DP-FedAvg, whose every round may include any client) and then
every client's ledger holds all of them, or one client's records (the federated record-level
methods) and then the clients' ledgers together hold each release once. A method that draws no
Gaussian noise (FedMD-NFDP: its guarantee is subsampling) must hold no Gaussian event.
"""

from __future__ import annotations

import sys
from collections import Counter

import dp_accounting as dpa
import pytest

from privkit.data import FederationConfig, build_federation
from privkit.methods import REGISTRY, get_trainer
from privkit.trainers import train

#: small settings per formal-DP method (each trains in seconds); a method missing here fails
SMALL: dict[str, dict] = {
    "dpsgd": {"epochs": 1, "batch_size": 256, "noise_multiplier": 1.3},
    "dp-fedavg": {"rounds": 2, "local_steps": 2, "target_epsilon": 1e6},
    "fedkadp": {"rounds": 2, "local_steps": 2, "target_epsilon": 1e6},
    "fedkd-dp": {"rounds": 2, "local_steps": 2, "target_epsilon": 1e6},
    "dp-fedavg-client": {"rounds": 3},
    "fedauxfdp": {"pretrain_epochs": 1, "student_epochs": 1},
    "fedavg-dphead": {"pretrain_epochs": 1, "student_epochs": 1},
    "fedd-dphead": {"pretrain_epochs": 1, "student_epochs": 1},
    "fedmd-nfdp": {"rounds": 1, "init_epochs": 1, "pretrain_epochs": 1, "public_subset": 100},
}
#: methods whose every release touches every client's records
POOLED = {"dpsgd", "dp-fedavg-client"}
FORMAL = sorted(name for name, spec in REGISTRY.items() if spec.formal_dp)


def _releases_in(event) -> list[tuple[float, float]]:
    """(sampling rate, noise multiplier) of each Gaussian release a ledger event stands for."""
    if isinstance(event, dpa.SelfComposedDpEvent):
        return _releases_in(event.event) * int(event.count)
    if isinstance(event, dpa.ComposedDpEvent):
        return [r for e in event.events for r in _releases_in(e)]
    if isinstance(event, dpa.PoissonSampledDpEvent) and isinstance(
        event.event, dpa.GaussianDpEvent
    ):
        return [(float(event.sampling_probability), float(event.event.noise_multiplier))]
    if isinstance(event, dpa.GaussianDpEvent):
        return [(1.0, float(event.noise_multiplier))]
    return []  # not a Gaussian release (e.g. FedMD-NFDP's subsampling guarantee)


def _spy_on_the_primitive(monkeypatch, tamper=None) -> list:
    """Replace every loaded binding of ``gaussian_release`` and ``gaussian_release_rows``;
    returns the list receipts go to (the rows' form: each row's).

    ``tamper(receipt)`` (optional): the receipt the spy hands back (and keeps) in place of the
    primitive's, a mechanism whose receipt misstates what it ran."""
    import privkit.mechanisms.gaussian as gaussian

    made: list = []

    def recording(real, rows: bool):
        def spy(*args, **kwargs):
            out, receipts = real(*args, **kwargs)
            kept = [
                tamper(r) if tamper is not None else r for r in (receipts if rows else [receipts])
            ]
            made.extend(kept)
            return out, (kept if rows else kept[0])

        spy.__wrapped__ = real  # type: ignore[attr-defined]
        return spy

    for attr, rows in (("gaussian_release", False), ("gaussian_release_rows", True)):
        real = getattr(gaussian, attr)
        spy = recording(real, rows)
        for name, module in list(sys.modules.items()):
            bound = getattr(module, attr, None)
            # a module first imported while an earlier test's spy was in place holds that spy
            if name.startswith("privkit") and (
                bound is real or getattr(bound, "__wrapped__", 0) is real
            ):
                monkeypatch.setattr(module, attr, spy)
    return made


def test_every_formal_method_has_small_settings():
    assert sorted(SMALL) == FORMAL


@pytest.mark.parametrize("method", FORMAL)
def test_the_ledger_holds_every_release_made_and_nothing_else(method, monkeypatch):
    assert callable(get_trainer(method).fn)  # its modules load before the spy replaces bindings
    made = _spy_on_the_primitive(monkeypatch)
    fed = build_federation(FederationConfig(partition="shards", clients=6, seed=0))
    cfg = {**get_trainer(method).quick_config(), **SMALL[method], "reproducible_noise": True}
    result = train(method, fed, cfg, seed=1)
    released = Counter(
        (1.0 if r.sample_rate is None else float(r.sample_rate), float(r.noise_multiplier))
        for r in made
        for _ in range(r.releases)
    )
    per_client = {
        c: Counter(r for e in result.ledger.entries(c) for r in _releases_in(e.event))
        for c in result.ledger.clients
    }
    if method == "fedmd-nfdp":  # no Gaussian noise: a guarantee from subsampling alone
        assert not released and result.ledger.clients
    else:
        assert released  # the spy saw the method's releases
    if method in POOLED:
        assert len(per_client) == fed.num_clients
        assert all(ledger == released for ledger in per_client.values())
    else:
        assert sum(per_client.values(), Counter()) == released
