"""privkit's release primitive (privkit.mechanisms.gaussian_release): the one place single-model
mechanisms draw Gaussian release noise, and the receipts the ledgers are built from.

* No module but the primitive (and the random sources it draws from) calls a Gaussian draw, apart
  from the listed draws that are not DP releases: the batched engines' block draws too go through
  it (:class:`~privkit.mechanisms.NormalRows`, :class:`~privkit.mechanisms.ModelRows`).
* Seeded, the primitive draws exactly what torch and numpy draw (bit for bit); its receipt is
  the event the accountants expect, and an audit's mutation changes the noise, never the receipt.
* DP-SGD through opacus records the receipts of the steps that ran: the ledger is their
  composition, equal to the planned event, one receipt per release.
"""

import ast
from pathlib import Path

import dp_accounting as dpa
import numpy as np
import pytest
import torch

from accountants import dpsgd_event
from privkit.errors import PrivkitError
from privkit.mechanisms import (
    Receipt,
    compose_receipts,
    gaussian_release,
    gaussian_release_rows,
    mutations,
)
from privkit.mechanisms.dp_random import DpRandom

ROOT = Path(__file__).resolve().parents[2] / "privkit"
DRAWS = {
    "randn",
    "randn_like",
    "normal",
    "normal_",
    "standard_normal",
    "grid_release",
    "rounded_gaussian",
}
#: modules allowed to call a Gaussian draw, and why
ALLOWED = {
    "mechanisms/gaussian.py": "the release primitive",
    "mechanisms/dp_random.py": "the random source the primitive draws from (DpRandom.randn)",
    "mechanisms/grid_noise.py": "the grid release the primitive calls in release mode",
    "mechanisms/grid_ahead.py": (
        "the grid release's draws on a device, made one release ahead (called by grid_release)"
    ),
    "trainers/flip.py": "FLiP's synthetic samples' initialisation (no DP release)",
    "trainers/pretrain.py": "data augmentation of public pre-training (no DP release)",
    "trainers/heads.py": "a random unit direction for a degenerate head (no DP release)",
    "mechanisms/ghost_affine.py": (
        "a random cotangent checking a linear layer's weight gradient on its first call (no DP "
        "release)"
    ),
    "batched/used_inputs.py": (
        "an audit's reference client's unused inputs' share of its round's releases, summed "
        "(the steps' releases hold its receipts; never released on its own)"
    ),
}


def _draw_sites() -> dict[str, list[int]]:
    sites: dict[str, list[int]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
                if name in DRAWS:
                    sites.setdefault(path.relative_to(ROOT).as_posix(), []).append(node.lineno)
    return sites


def test_no_module_but_the_primitive_draws_release_noise():
    sites = _draw_sites()
    stray = {m: lines for m, lines in sites.items() if m not in ALLOWED}
    assert not stray, f"Gaussian draws outside privkit.mechanisms.gaussian_release: {stray}"
    assert "mechanisms/gaussian.py" in sites  # the scan sees draws at all


def test_seeded_draws_are_torch_s_and_numpy_s_own():
    clean = {"b": torch.zeros(3), "a": torch.ones(40, 2)}
    out, receipt = gaussian_release(
        clean, std=0.7, sensitivity=2.0, source=torch.Generator().manual_seed(5)
    )
    g = torch.Generator().manual_seed(5)
    assert torch.equal(out["a"], clean["a"] + 0.7 * torch.randn((40, 2), generator=g))
    assert torch.equal(out["b"], clean["b"] + 0.7 * torch.randn(3, generator=g))  # sorted names
    assert receipt == Receipt(0.35, 2.0, None, 1)
    x = np.arange(6.0).reshape(2, 3)
    out_np, r2 = gaussian_release(
        x, std=1.5, sensitivity=1.0, source=np.random.default_rng(3), releases=2, dim=3
    )
    np.testing.assert_array_equal(out_np, x + np.random.default_rng(3).normal(0.0, 1.5, (2, 3)))
    assert r2.event == dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(1.5), 2)


def test_row_blocks_are_drawn_as_their_concatenation():
    """Several releases given as column blocks (a list of ``(releases, width)`` tensors, views of
    stacked sums): each row is one release of the blocks' concatenated row, and seeded noise takes
    the numbers one draw of that concatenation takes; the blocks themselves are left alone; a block
    of another row count is refused by name."""
    gen = torch.Generator().manual_seed(0)
    stacked = torch.randn(4, 6, generator=gen)
    blocks = [stacked[1:4, :2], stacked[1:4, 2:]]  # non-contiguous views, three releases
    before = stacked.clone()
    out, receipt = gaussian_release(
        blocks, std=0.3, sensitivity=1.0, source=torch.Generator().manual_seed(4), releases=3, dim=6
    )
    z = torch.randn((3, 6), generator=torch.Generator().manual_seed(4))
    assert torch.equal(torch.cat(out, 1), before[1:4] + 0.3 * z)
    assert torch.equal(stacked, before)
    assert receipt == Receipt(0.3, 1.0, None, 3)
    with pytest.raises(Exception, match=r"releases=3 over several tensors"):
        gaussian_release(
            [stacked[1:4], stacked[:2]],
            std=0.3,
            sensitivity=1.0,
            source=torch.Generator(),
            releases=3,
        )


def test_a_mutation_changes_the_noise_never_the_receipt():
    clean = torch.zeros(1000)
    plain, r1 = gaussian_release(
        clean, std=1.0, sensitivity=1.0, source=torch.Generator().manual_seed(1), sample_rate=0.1
    )
    with mutations.mutated(mutations.MUTATIONS["noise x1/2"]):
        half, r2 = gaussian_release(
            clean,
            std=1.0,
            sensitivity=1.0,
            source=torch.Generator().manual_seed(1),
            sample_rate=0.1,
        )
    assert r1 == r2 and r1.event == dpa.PoissonSampledDpEvent(0.1, dpa.GaussianDpEvent(1.0))
    assert torch.allclose(half, 0.5 * plain)


def test_rows_of_unequal_rates_are_one_draw_with_a_receipt_per_row():
    """gaussian_release_rows: the numbers and mutation of one ``releases=n`` release of the rows,
    each row's receipt at its own rate (what n releases of one row each would state), and a rate
    outside (0, 1] named."""
    clean = [torch.randn(3, 4), torch.randn(3, 2)]
    rates = [0.1, None, 0.3]
    kw = {"std": 2.0, "sensitivity": 0.5}
    with mutations.mutated(mutations.MUTATIONS["noise x1/2"]):
        rows, receipts = gaussian_release_rows(
            clean, **kw, source=torch.Generator().manual_seed(4), sample_rates=rates
        )
        block, _ = gaussian_release(
            clean, **kw, source=torch.Generator().manual_seed(4), releases=3
        )
    assert all(torch.equal(a, b) for a, b in zip(rows, block))
    z = torch.randn((3, 6), generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(torch.cat(rows, 1), torch.cat(clean, 1) + 1.0 * z)  # noise x1/2
    assert receipts == [Receipt(4.0, 0.5, rate) for rate in rates]
    with pytest.raises(PrivkitError, match=r"sample_rate must be in \(0, 1\]; found 0.0"):
        gaussian_release_rows(clean, **kw, source=torch.Generator(), sample_rates=[0.1, 0.0, 0.2])
    # drawn into a caller's buffer: the same numbers, the rows views of it; a buffer of another
    # shape, or for the release stream, named
    out = torch.full((3, 6), float("nan"))
    again, _ = gaussian_release_rows(
        clean, **kw, source=torch.Generator().manual_seed(4), sample_rates=rates, out=out
    )
    assert torch.equal(torch.cat(again, 1), 2.0 * z + torch.cat(clean, 1))
    assert all(r.data_ptr() == out[0, at:].data_ptr() for r, at in zip(again, (0, 4)))
    with pytest.raises(PrivkitError, match=r"out must be a \(3, 6\) tensor .* found \(3, 5\)"):
        gaussian_release_rows(
            clean, **kw, source=torch.Generator(), sample_rates=rates, out=torch.empty(3, 5)
        )
    with pytest.raises(PrivkitError, match="seeded=False"):
        gaussian_release_rows(
            clean, **kw, source=DpRandom.secret(), sample_rates=rates, out=torch.empty(3, 6)
        )


def test_rows_may_each_take_their_own_noise_scale():
    """gaussian_release_rows with one std per row (FedKADP's reference runs adapt theirs): the
    draw of one scale, each row scaled by its own (an audit's mutation on top), each receipt at
    its row's multiplier; refused where the rows are not seeded torch rows of several tensors."""
    clean = [torch.zeros(3, 4), torch.zeros(3, 2)]
    stds, rates = [0.5, 1.0, 3.0], [0.1, 0.2, None]
    z = torch.randn((3, 6), generator=torch.Generator().manual_seed(9))
    rows, receipts = gaussian_release_rows(
        clean,
        std=stds,
        sensitivity=0.5,
        source=torch.Generator().manual_seed(9),
        sample_rates=rates,
    )
    assert torch.equal(torch.cat(rows, 1), z * torch.tensor(stds)[:, None])
    assert receipts == [Receipt(v / 0.5, 0.5, rate) for v, rate in zip(stds, rates)]
    with mutations.mutated(mutations.MUTATIONS["noise x1/2"]):
        halved, again = gaussian_release_rows(
            clean,
            std=stds,
            sensitivity=0.5,
            source=DpRandom(torch.Generator().manual_seed(9)),
            sample_rates=rates,
        )
    torch.testing.assert_close(torch.cat(halved, 1), 0.5 * z * torch.tensor(stds)[:, None])
    assert again == receipts  # the mutation changes the noise, never the receipts
    # equal scales: the one-scale release, bit for bit
    one, _ = gaussian_release_rows(
        clean,
        std=[2.0] * 3,
        sensitivity=0.5,
        source=torch.Generator().manual_seed(9),
        sample_rates=rates,
    )
    assert torch.equal(torch.cat(one, 1), 2.0 * z)
    with pytest.raises(PrivkitError, match=r"std must give one scale per row; found 2 for 3 rows"):
        gaussian_release_rows(
            clean, std=[1.0, 2.0], sensitivity=0.5, source=torch.Generator(), sample_rates=rates
        )
    with pytest.raises(PrivkitError, match=r"std must be a finite number >= 0; found -1\.0"):
        gaussian_release_rows(
            clean,
            std=[1.0, -1.0, 2.0],
            sensitivity=0.5,
            source=torch.Generator(),
            sample_rates=rates,
        )
    with pytest.raises(PrivkitError, match="a noise scale per row needs"):
        gaussian_release_rows(
            clean, std=stds, sensitivity=0.5, source=DpRandom.secret(), sample_rates=rates
        )
    with pytest.raises(PrivkitError, match="a noise scale per row needs"):
        gaussian_release_rows(
            torch.zeros(3, 6),
            std=stds,
            sensitivity=0.5,
            source=torch.Generator(),
            sample_rates=rates,
        )


def test_receipts_compose_to_the_accountants_events():
    step = Receipt(1.1, 1.0, 0.01)
    assert compose_receipts([step] * 50) == dpsgd_event(0.01, 1.1, 50)
    assert compose_receipts([step]) == dpsgd_event(0.01, 1.1, 1)
    other = Receipt(2.0, 1.0, None)
    assert compose_receipts([step, step, other]) == dpa.ComposedDpEvent(
        [dpsgd_event(0.01, 1.1, 2), dpa.GaussianDpEvent(2.0)]
    )
    with pytest.raises(Exception, match="at least one receipt"):
        compose_receipts([])


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"std": -1.0}, "std must be"),
        ({"sensitivity": 0.0}, "sensitivity must be"),
        ({"sample_rate": 1.5}, "sample_rate must be"),
    ],
)
def test_bad_parameters_are_named(bad, match):
    kw = {"std": 1.0, "sensitivity": 1.0, "source": torch.Generator(), **bad}
    with pytest.raises(Exception, match=match):
        gaussian_release(torch.zeros(2), **kw)


def test_dpsgd_ledger_is_the_composition_of_the_receipts_of_every_step(monkeypatch):
    """Every opacus step's noise goes through the primitive, one receipt per release, and the
    ledger's event is their composition (equal to the planned event)."""
    from privkit.data import FederationConfig, build_federation
    from privkit.mechanisms import opacus_streams
    from privkit.trainers import train

    drawn = []
    real = opacus_streams.use_noise_source

    def counting(dp_opt, source):
        receipts = real(dp_opt, source)
        drawn.append(receipts)
        return receipts

    monkeypatch.setattr("privkit.trainers.dpsgd.use_noise_source", counting)
    fed = build_federation(FederationConfig(partition="shards", clients=4, seed=0))
    cfg = {"epochs": 1, "batch_size": 256, "noise_multiplier": 1.3, "reproducible_noise": True}
    result = train("dpsgd", fed, cfg, seed=0)
    (receipts,) = drawn
    steps = result.claims["steps"]
    assert len(receipts) == steps > 0
    assert all(r == receipts[0] for r in receipts)
    assert receipts[0].noise_multiplier == pytest.approx(1.3)
    event = result.ledger.to_dict()
    assert compose_receipts(receipts) == dpsgd_event(result.claims["sample_rate"], 1.3, steps)
    assert event  # the ledger holds it for every client (its JSON form is the planned event's)


def _releases_in(event) -> list[tuple[float, float]]:
    """(sample rate, noise multiplier) of each release a ledger event stands for."""
    if isinstance(event, dpa.SelfComposedDpEvent):
        return _releases_in(event.event) * int(event.count)
    if isinstance(event, dpa.ComposedDpEvent):
        return [r for e in event.events for r in _releases_in(e)]
    if isinstance(event, dpa.PoissonSampledDpEvent):
        return [(float(event.sampling_probability), float(event.event.noise_multiplier))]
    return [(1.0, float(event.noise_multiplier))]


def test_dp_fedavg_ledger_holds_every_release_and_nothing_else(monkeypatch):
    """Every DP-SGD release a dp-fedavg run makes is in its ledger (count and parameters), and
    every ledger release was made: the ledger is composed from the receipts."""
    from privkit.data import FederationConfig, build_federation
    from privkit.mechanisms import dp_sgd_step
    from privkit.trainers import train

    made = []
    real = dp_sgd_step.gaussian_release

    def recording(clean, **kw):
        out, receipt = real(clean, **kw)
        made.append((receipt.sample_rate, receipt.noise_multiplier))
        return out, receipt

    monkeypatch.setattr(dp_sgd_step, "gaussian_release", recording)
    fed = build_federation(FederationConfig(partition="shards", clients=8, seed=0))
    cfg = {
        "arch": "mlp",
        "feature_dim": 16,
        "rounds": 3,
        "local_steps": 2,
        "batch_size": 32,
        "client_fraction": 0.5,
        "noise_multiplier": 1.7,
        "target_epsilon": 1e6,
        "reproducible_noise": True,
    }
    result = train("dp-fedavg", fed, cfg, seed=1)
    ledger = [
        r
        for c in result.ledger.clients
        for e in result.ledger.entries(c)
        for r in _releases_in(e.event)
    ]
    assert len(made) == 3 * 4 * 2 == len(ledger)
    assert sorted(made) == sorted(ledger)


def test_normal_rows_keep_a_block_draw_s_bits():
    """A batched engine's block of steps' noise, handed out one row per release: the numbers of
    the block draw, each release through the primitive (and sized: one row too many is refused)."""
    from privkit.mechanisms import NormalRows

    g = torch.Generator().manual_seed(2)
    first, second = torch.randn(3, 5, generator=g), torch.randn(1, 5, generator=g)
    rows = NormalRows(torch.Generator().manual_seed(2), width=5, total=4, block=3)
    clean = [torch.zeros(2), torch.ones(3)]
    for z in [first[0], first[1], first[2], second[0]]:
        out, receipt = gaussian_release(clean, std=0.5, sensitivity=1.0, source=rows)
        assert torch.equal(torch.cat(out), torch.cat(clean) + 0.5 * z)
    assert receipt.noise_multiplier == 0.5
    with pytest.raises(Exception, match="every release it was sized for"):
        gaussian_release(clean, std=0.5, sensitivity=1.0, source=rows)


def test_normal_rows_release_in_the_clean_values_dtype():
    """A row is released in place on the drawn row where the clean values share its dtype (the
    row is the release's: the next release takes the next row), and in the clean values' dtype
    otherwise."""
    from privkit.mechanisms import NormalRows

    z = torch.randn(2, 3, generator=torch.Generator().manual_seed(7))
    rows = NormalRows(torch.Generator().manual_seed(7), width=3, total=2, block=2)
    single, _ = gaussian_release(torch.ones(3), std=2.0, sensitivity=1.0, source=rows)
    double, _ = gaussian_release(
        torch.ones(3, dtype=torch.float64), std=2.0, sensitivity=1.0, source=rows
    )
    assert single.dtype == torch.float32 and torch.equal(single, torch.ones(3) + 2.0 * z[0])
    assert double.dtype == torch.float64
    assert torch.equal(double, torch.ones(3, dtype=torch.float64) + 2.0 * z[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_values_are_released_in_float32_then_rounded(dtype):
    """Noise drawn and added in half precision is not Gaussian noise on the value (bfloat16's
    spacing is 8 at 1000, the noise's deviation 0.5 here): the release is the float32 one of the
    same values, rounded back to their dtype after (post-processing), seeded bit for bit; in
    release mode (its grid) the values still move, in their dtype."""
    clean = {"w": torch.linspace(0.5, 3.0, 256).to(dtype), "b": torch.linspace(-1, 1, 8)}
    got, receipt = gaussian_release(
        clean, std=0.3, sensitivity=1.0, source=torch.Generator().manual_seed(3)
    )
    wide = {k: v.float() for k, v in clean.items()}
    want, _ = gaussian_release(
        wide, std=0.3, sensitivity=1.0, source=torch.Generator().manual_seed(3)
    )
    # (drawn, scaled and added in half precision, 11% of the bfloat16 values came out otherwise)
    assert got["w"].dtype == dtype and torch.equal(got["w"], want["w"].to(dtype))
    assert torch.equal(got["b"], want["b"]) and receipt.noise_multiplier == 0.3
    released, _ = gaussian_release(
        torch.zeros(4000, dtype=dtype), std=0.5, sensitivity=1.0, source=DpRandom.secret()
    )
    assert released.dtype == dtype
    assert abs(float(released.float().std()) - 0.5) < 0.05  # the grid's noise, then rounded
    half = np.full(16, 1000.0, dtype=np.float16)
    out, _ = gaussian_release(half, std=0.5, sensitivity=1.0, source=np.random.default_rng(5))
    ref, _ = gaussian_release(
        half.astype(np.float32), std=0.5, sensitivity=1.0, source=np.random.default_rng(5)
    )
    assert out.dtype == np.float16 and np.array_equal(out, ref.astype(np.float16))


def test_a_bfloat16_release_s_low_bits_do_not_tell_neighbours_apart():
    """The floating-point attack, in bfloat16: drawn and added in it, a release from 0 lands off
    the 2**-8 grid near zero 47% of the time, a release from 1 never (1 plus noise is rounded
    onto that grid there): such a release tells 0 from 1 almost half the time, whatever the
    noise. Released in float32 and rounded after, both land there alike."""
    n = 200_000

    def off_grid(value: float) -> float:
        clean = torch.full((n,), value, dtype=torch.bfloat16)
        out, _ = gaussian_release(
            clean, std=0.5, sensitivity=1.0, source=torch.Generator().manual_seed(int(value))
        )
        near = out.float()[out.float().abs() < 0.5]
        return float(((near * 256) != torch.round(near * 256)).float().mean())

    from_zero, from_one = off_grid(0.0), off_grid(1.0)
    assert from_zero > 0.4 and from_one > 0.4


def test_model_rows_keep_the_stacked_engine_s_block_draws():
    """Models trained at once (a leading model axis), each with its own stream drawn a block of
    steps at a time: model j's row of each step is its stream's block draw, row by row, one
    release per model through the primitive; a model whose releases have run out gets zeros,
    and a step past the last is refused."""
    from privkit.mechanisms import ModelRows

    width, std = 5, 0.5
    gens = [torch.Generator().manual_seed(s) for s in (3, 4)]
    rows = ModelRows(gens, width=width, totals=[3, 1], block=2)
    g3, g4 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(4)
    own = [
        torch.cat([torch.randn(2, width, generator=g3), torch.randn(1, width, generator=g3)]),
        torch.cat([torch.randn(1, width, generator=g4), torch.zeros(2, width)]),
    ]
    clean = [torch.ones(2, 2), torch.zeros(2, 3)]  # two models' releases of 2 + 3 numbers
    for t in range(3):
        out, receipt = gaussian_release(clean, std=std, sensitivity=1.0, source=rows)
        for j in range(2):
            want = torch.cat([clean[0][j], clean[1][j]]) + std * own[j][t]
            assert torch.allclose(torch.cat([out[0][j], out[1][j]]), want, rtol=0, atol=1e-7)
        assert torch.equal(out[0][1], clean[0][1]) == (t > 0)  # model 1's noise has run out
    assert receipt.noise_multiplier == std and receipt.releases == 1
    with pytest.raises(Exception, match="every step it was sized for"):
        gaussian_release(clean, std=std, sensitivity=1.0, source=rows)


def test_reference_runs_of_different_noise_release_together_at_their_own_scales(monkeypatch):
    """Reference runs whose clients hold different noise multipliers within a step (FedKADP's runs
    adapt theirs; here dp-fedavg runs configured apart) are released in one draw a step, each row
    at its own scale; each run's ledger admits what its clients released (``finish_round``
    refuses any other receipt) and records its own multiplier."""
    from audit_helpers import TINY_DPFED

    from privkit.batched import many
    from privkit.batched.many_dpfed import train_dpfed_many
    from privkit.data import FederationConfig, build_federation
    from privkit.methods.contract import make_config

    calls: list = []
    original = many.joint_release

    def spy(sums, rows, **kw):
        calls.append((len(rows), kw["std"]))
        return original(sums, rows, **kw)

    monkeypatch.setattr(many, "joint_release", spy)
    fed = build_federation(FederationConfig(partition="dirichlet", clients=20, seed=0))
    sigmas = [1.0, 0.8, 1.3, 2.0]
    configs = [  # the reference runs seeded, as an audit's (FederationRecipe.config_for)
        make_config("dp-fedavg", {**TINY_DPFED, "noise_multiplier": s, "reproducible_noise": i > 0})
        for i, s in enumerate(sigmas)
    ]
    runs = train_dpfed_many("dp-fedavg", [fed] * 4, configs, [1, 2, 3, 4], [False] + [True] * 3)
    per_round = len(runs[1].rounds[0]["clients"])
    assert len(calls) == TINY_DPFED["rounds"] * TINY_DPFED["local_steps"]  # one draw a step
    for n, std in calls:
        assert n == 3 * per_round
        assert sorted(set(std)) == sorted(sigmas[1:])  # the clip norm is 1: std = multiplier
    for run, sigma in zip(runs, sigmas):
        entries = [e for rows in run.ledger.to_dict()["clients"].values() for e in rows]
        inner = [e["event"]["fields"]["event"]["fields"]["event"]["fields"] for e in entries]
        assert entries and {f["noise_multiplier"] for f in inner} == {sigma}
