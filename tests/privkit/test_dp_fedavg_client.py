"""Client-level DP-FedAvg (``dp-fedavg-client``, McMahan et al. 2018, fixed clipping): its ledger
against dp-accounting by hand, every release in the ledger, the clipping bound, the noise-free twin
against clipped FedAvg by hand, one-line errors, its registration and the report's labels.

The federation: scikit-learn's 8x8 digits over 4 clients (seconds).
"""

from __future__ import annotations

import copy
import json
import math

import dp_accounting as dpa
import pytest
import torch
from pydantic import ValidationError
from typer.testing import CliRunner

from privkit.cli import app
from privkit.data import FederationConfig, build_federation
from privkit.errors import PrivkitError
from privkit.methods import REGISTRY, get_trainer, make_config
from privkit.seeding import derive_seed
from privkit.trainers import train
from privkit.trainers.common import new_model, train_supervised
from privkit.trainers.dp_fedavg_client import clip_update, server_update

DELTA = 1e-5
SMALL = {"feature_dim": 16, "batch_size": 64, "lr": 0.1, "reproducible_noise": True}


@pytest.fixture(scope="module")
def fed():
    return build_federation(
        FederationConfig(
            dataset="digits", public_dataset=None, public_size=0.1, clients=4, partition="iid"
        )
    )


@pytest.fixture(scope="module")
def noisy_run(fed, request):
    """q = 0.5, z = 1.1, S = 0.7, 4 rounds; every call of the release primitive recorded."""
    import privkit.mechanisms.gaussian as gaussian

    calls = []
    real = gaussian.gaussian_release

    def spy(clean, **kw):
        out = real(clean, **kw)
        calls.append((kw, out[1]))
        return out

    mp = pytest.MonkeyPatch()
    mp.setattr(gaussian, "gaussian_release", spy)
    try:
        cfg = {**SMALL, "rounds": 4, "client_rate": 0.5, "noise_multiplier": 1.1, "clip_norm": 0.7}
        result = train("dp-fedavg-client", fed, cfg, seed=3)
    finally:
        mp.undo()
    return result, calls


def _by_hand(q: float, z: float, rounds: int, kind: str) -> float:
    rel = dpa.NeighboringRelation.ADD_OR_REMOVE_ONE
    acc = (
        dpa.rdp.RdpAccountant(neighboring_relation=rel)
        if kind == "rdp"
        else dpa.pld.PLDAccountant(rel, value_discretization_interval=1e-4)
    )
    for _ in range(rounds):
        acc.compose(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z)))
    return float(acc.get_epsilon(DELTA))


def test_ledger_epsilon_is_dp_accountings_by_hand(noisy_run, fed):
    result, _ = noisy_run
    for kind in ("rdp", "pld"):
        hand = _by_hand(0.5, 1.1, 4, kind)
        for k in range(fed.num_clients):  # every client: each round's coins touch all of them
            got = result.ledger.epsilon(DELTA, client=k, accountant=kind)
            assert got == pytest.approx(hand, rel=1e-6 if kind == "rdp" else 1e-3), (kind, k)
    # the rounds' epsilons are the same numbers, round by round (rdp, the default)
    assert [r["epsilon"] for r in result.rounds] == pytest.approx(
        [_by_hand(0.5, 1.1, t, "rdp") for t in (1, 2, 3, 4)], rel=1e-6
    )


def test_every_release_is_in_the_ledger(noisy_run, fed):
    result, calls = noisy_run
    assert len(calls) == 4  # one release per round, whatever the number of sampled clients
    for kw, receipt in calls:
        assert kw["std"] == pytest.approx(1.1 * 0.7)
        assert kw["sensitivity"] == 0.7 and kw["sample_rate"] == 0.5
        assert receipt.event == dpa.PoissonSampledDpEvent(0.5, dpa.GaussianDpEvent(1.1))
    for k in range(fed.num_clients):
        entries = result.ledger.entries(k)
        assert [e.round for e in entries] == [1, 2, 3, 4]
        assert [e.label for e in entries] == [
            f"round {t}: client-level gaussian" for t in (1, 2, 3, 4)
        ]
        assert all(e.event == calls[0][1].event for e in entries)
        assert all(e.neighbouring == "add_remove" for e in entries)
    sampled = [len(r["clients"]) for r in result.rounds]
    assert all(0 <= s <= fed.num_clients for s in sampled)


def _state(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a.weight": scale * torch.rand((3, 4), generator=g),
        "b": scale * torch.rand(5, generator=g),
    }


def test_a_huge_update_moves_the_model_by_at_most_S_over_qN():
    """Noise 0: adding a client whose update is huge changes the new global model by at most
    S / (q N); the result is the clipped sum over q N, computed by hand."""
    S, q, N = 0.5, 0.25, 8
    glob = _state(0)
    small = [{k: v + 0.01 * (i + 1) for k, v in glob.items()} for i in range(2)]
    huge = {k: v + 1e6 * (j + 1) for j, (k, v) in enumerate(glob.items())}
    kw = {"clip_norm": S, "noise_multiplier": 0.0, "client_rate": q, "num_clients": N}
    src = torch.Generator().manual_seed(0)
    without, _, _ = server_update(glob, small, source=src, **kw)
    with_, receipt, norms = server_update(glob, [*small, huge], source=src, **kw)
    change = math.sqrt(sum(float((with_[k] - without[k]).pow(2).sum()) for k in glob))
    assert change <= S / (q * N) * (1 + 1e-6)
    assert change == pytest.approx(S / (q * N), rel=1e-5)  # the huge update clipped to exactly S
    assert norms[2] > 1e6
    # by hand: each delta scaled to norm min(||d||, S), summed, over q N
    deltas = [{k: s[k] - glob[k] for k in glob} for s in (*small, huge)]
    hand = {k: torch.zeros_like(v) for k, v in glob.items()}
    for d in deltas:
        n = math.sqrt(sum(float(v.double().pow(2).sum()) for v in d.values()))
        for k in d:
            hand[k] += d[k] * min(1.0, S / n)
    for k in glob:
        torch.testing.assert_close(with_[k], glob[k] + hand[k] / (q * N))
    assert receipt.noise_multiplier == 0.0 and receipt.sample_rate == q


def test_the_noise_is_z_S_on_the_sum_from_the_seeded_stream():
    S, z, q, N = 0.5, 2.0, 0.5, 4
    glob, local = _state(1), _state(2)
    new, receipt, _ = server_update(
        glob,
        [local],
        clip_norm=S,
        noise_multiplier=z,
        client_rate=q,
        num_clients=N,
        source=torch.Generator().manual_seed(7),
    )
    clipped, _ = clip_update({k: local[k] - glob[k] for k in glob}, S)
    g = torch.Generator().manual_seed(7)
    noise = {k: torch.randn(glob[k].shape, generator=g) for k in sorted(glob)}  # sorted names
    for k in glob:
        torch.testing.assert_close(new[k], glob[k] + (clipped[k] + z * S * noise[k]) / (q * N))
    assert receipt.event == dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z))


def test_the_noise_free_twin_is_clipped_fedavg_by_hand(fed):
    """z = 0, q = 1, 2 rounds: every client each round, the mean of the clipped updates (q N = N);
    each client's local training redone here with plain SGD from the same model and seed."""
    cfg = {**SMALL, "rounds": 2, "client_rate": 1.0, "noise_multiplier": 0.0, "clip_norm": 0.3}
    cfg["local_epochs"] = 2
    result = train("dp-fedavg-client", fed, cfg, seed=5)
    c = make_config("dp-fedavg-client", cfg)
    model, _ = new_model(fed, c, derive_seed(5, "init"))
    for t in (1, 2):
        glob = {k: v.detach().clone() for k, v in model.state_dict().items()}
        total = {k: torch.zeros_like(v) for k, v in glob.items()}
        for k in range(fed.num_clients):
            local = copy.deepcopy(model)
            x, y = fed.client_arrays(k)
            train_supervised(
                local,
                x,
                y,
                epochs=2,
                batch_size=64,
                lr=0.1,
                device=torch.device("cpu"),
                seed=derive_seed(5, f"round{t}/client{k}"),
                optimizer="sgd",
            )
            d = {n: local.state_dict()[n] - glob[n] for n in glob}
            norm = math.sqrt(sum(float(v.double().pow(2).sum()) for v in d.values()))
            for n in d:
                total[n] += d[n] * min(1.0, 0.3 / norm)
        model.load_state_dict({n: glob[n] + total[n] / fed.num_clients for n in glob})
    for n, v in model.state_dict().items():
        torch.testing.assert_close(result.model.state_dict()[n], v, rtol=1e-5, atol=1e-6)
    assert [r["clients"] for r in result.rounds] == [list(range(fed.num_clients))] * 2
    assert math.isinf(result.ledger.epsilon(DELTA, client=0, accountant="rdp"))
    assert any("no formal DP guarantee" in w for w in result.warnings)
    from privkit.pipeline.report import classify_warning

    heads = ("Accounting is client-level", "The server is trusted", "noise_multiplier = 0")
    codes = [classify_warning(next(w for w in result.warnings if w.startswith(h))) for h in heads]
    assert codes == ["other", "other", "no_formal_dp"]


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("client_rate", 0.0),
        ("client_rate", 1.5),
        ("noise_multiplier", -1.0),
        ("clip_norm", 0.0),
        ("local_epochs", 0),
        ("rounds", 0),
        ("target_epsilon", -2.0),
    ],
)
def test_bad_values_are_refused_naming_the_parameter(key, value, capsys):
    from privkit.cli.app import main

    with pytest.raises(ValidationError, match=key):
        make_config("dp-fedavg-client", {key: value})
    with pytest.raises(SystemExit) as exit_:
        main(["train", "dp-fedavg-client", "--quick", "--set", f"{key}={value}", "--out", "unused"])
    assert exit_.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and key in lines[0], lines


def test_a_budget_smaller_than_one_round_is_one_line(fed):
    with pytest.raises(PrivkitError, match=r"^target_epsilon must allow at least one round"):
        train("dp-fedavg-client", fed, {**SMALL, "target_epsilon": 0.01}, seed=0)


def test_the_budget_stops_before_the_round_that_would_pass_it(fed):
    cfg = {**SMALL, "rounds": 10, "client_rate": 0.5, "noise_multiplier": 1.1, "clip_norm": 0.7}
    limit = _by_hand(0.5, 1.1, 3, "rdp") * 1.0001  # three rounds fit, the fourth does not
    result = train("dp-fedavg-client", fed, {**cfg, "target_epsilon": limit}, seed=1)
    assert len(result.rounds) == 3
    assert result.ledger.epsilon(DELTA, accountant="rdp") <= limit
    assert any("stopped before round 4" in w for w in result.warnings)


def test_registration_and_listing_say_client_level_and_record_level():
    spec = get_trainer("dp-fedavg-client")
    assert (spec.level, spec.formal_dp) == ("client", True)
    assert "McMahan" in spec.paper and "client-level" in spec.summary.lower()
    assert get_trainer("dp-fedavg").level == "record"
    assert get_trainer("dp-fedavg").summary.startswith("Record-level DP-FedAvg")
    res = CliRunner().invoke(app, ["train", "--list", "--json"])
    assert res.exit_code == 0, res.output
    rows = {m["name"]: m for m in json.loads(res.stdout)["methods"]}
    assert rows["dp-fedavg-client"]["level"] == "client"
    assert rows["dp-fedavg"]["level"] == "record"
    assert {m["level"] for m in rows.values()} <= {"record", "client"}
    assert rows.keys() == REGISTRY.keys()


def test_record_canaries_refuse_a_client_level_method(fed):
    from privkit.audit.federated_canaries import audit_client_canaries

    cfg = get_trainer("dp-fedavg-client").quick_config()
    with pytest.raises(PrivkitError, match=r"record-level claim .*'dp-fedavg-client'"):
        audit_client_canaries(fed, "dp-fedavg-client", cfg, delta=DELTA, n=10)


class _Audit:
    def to_dict(self):
        return {"status": "consistent", "message": "no violation", "analysis": "mechanism"}


@pytest.mark.parametrize(
    ("what", "level", "label"),
    [
        ("the server's client-level Gaussian", None, "canary-client audit (client-level)"),
        ("node 0's DP-SGD", "record", "canary-record audit (record-level)"),
        ("the app's Gaussian", None, "white-box canary audit"),
    ],
)
def test_a_flower_audit_row_says_which_canaries(tmp_path, what, level, label):
    """A Flower run's audit (write_audit) is labelled by its canaries, never "black-box audit"."""
    from flower_testapps import report_row

    from accountants import Ledger
    from privkit.flower.rundir import write_audit, write_run

    ledger = Ledger()
    ledger.add(0, dpa.GaussianDpEvent(5.0), "round 1: gaussian", round=1, neighbouring="add_remove")
    run = write_run(tmp_path, "app", ledger, DELTA, rounds=[], description=[], stop=None)
    write_audit(run, _Audit(), DELTA, what, level=level)
    row = report_row(tmp_path, "app")
    assert f"| {label} |" in row, row
    assert "black-box" not in row
    md = (tmp_path / "report.md").read_text()
    assert "one client's whole data" in md  # the unit of a Flower run's epsilon


def test_write_audit_refuses_an_unknown_level(tmp_path):
    from accountants import Ledger
    from privkit.flower.rundir import write_audit, write_run

    ledger = Ledger()
    ledger.add(0, dpa.GaussianDpEvent(5.0), "round 1: gaussian", round=1)
    run = write_run(tmp_path, "app", ledger, DELTA, rounds=[], description=[], stop=None)
    with pytest.raises(ValueError, match=r"^level must be one of client, record; found 'user'"):
        write_audit(run, _Audit(), DELTA, "x", level="user")


def test_the_report_names_a_client_level_method(tmp_path):
    """A pipeline run with dp-fedavg-client: the threat model's unit is a client's whole data."""
    from privkit.pipeline.report import build_report

    entry = {"key": "dpfc", "method": "dp-fedavg-client", "seed": 0, "level": "client"}
    (tmp_path / "config.resolved.json").write_text(
        json.dumps({"name": "r", "delta": DELTA, "resolved_methods": [entry]})
    )
    mdir = tmp_path / "dpfc"
    mdir.mkdir()
    summary = {"worst": {"best": 5.0, "rdp": 5.0}, "clients": {"0": {"best": 5.0, "rdp": 5.0}}}
    (mdir / "privacy.json").write_text(json.dumps({"delta": DELTA, "summary": summary}))
    verdict = {"status": "consistent", "message": "no violation"}
    (mdir / "audit.json").write_text(json.dumps({"verdict": verdict, "accounted_epsilon": 5.0}))
    report = build_report(tmp_path)
    (m,) = report.methods
    assert m.verdict_basis == "black-box"  # a record-level membership audit of a client claim
    assert any("tests records against a client-level epsilon" in w.message for w in m.warnings)
    assert report.threat_model.unit and "client-level" in report.threat_model.unit
    assert "central DP at a trusted server" in report.threat_model.unit
    assert any(
        "Client-level (user-level) epsilons for dpfc" in a for a in report.threat_model.assumptions
    )


def test_a_run_for_release_keeps_the_draw_and_the_raw_norms_to_itself(fed):
    """Release mode: the rounds' metrics say nothing of which clients were drawn (the amplification
    assumes the draw hidden) nor of the unclipped updates' norms."""
    cfg = {**SMALL, "reproducible_noise": False, "rounds": 2}
    result = train("dp-fedavg-client", fed, cfg, seed=0)
    assert [sorted(r) for r in result.rounds] == [["epsilon", "round", "test_accuracy"]] * 2
    assert not result.ledger.reproducible_noise
