"""privkit.check and ``privkit check``: each finding on real opacus, torch and Flower objects, its
epsilons against an independent computation (dp-accounting directly, a closed form, privkit's own
shuffle accountant for the certified lower bound), the exit codes and one line per finding."""

from __future__ import annotations

import json
import math
import textwrap
import warnings

import dp_accounting as dpa
import pytest
import torch
from scipy import optimize, stats

pytest.importorskip("flwr")

from flwr.clientapp import ClientApp
from flwr.clientapp.mod import LocalDpMod
from flwr.serverapp.strategy import DifferentialPrivacyClientSideAdaptiveClipping, FedAvg
from opacus import PrivacyEngine
from opacus.data_loader import DPDataLoader
from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    TensorDataset,
    WeightedRandomSampler,
)

from accountants.samplers import sampler_accounting
from privkit.check import Finding, check_training
from privkit.cli import main
from privkit.flower import recorded

DELTA, SIGMA, STEPS = 1e-5, 1.5, 100
PLD_REL = 3e-3  # privkit's PLD grid is 1e-4, the direct computation's 1e-3 (each pessimistic)
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # opacus: "Secure RNG turned off"


def poisson_pld(q: float, sigma: float = SIGMA, steps: int = STEPS) -> float:
    """dp-accounting's PLD of Poisson-sampled DP-SGD, called directly."""
    acc = dpa.pld.PLDAccountant(value_discretization_interval=1e-3)
    acc.compose(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma)), steps)
    return float(acc.get_epsilon(DELTA))


def gaussian_exact(sigma: float) -> float:
    """Exact epsilon of a Gaussian of multiplier sigma (Balle & Wang 2018's closed form)."""

    def excess(eps: float) -> float:
        a, b = -eps * sigma + 1 / (2 * sigma), -eps * sigma - 1 / (2 * sigma)
        return stats.norm.cdf(a) - math.exp(eps) * stats.norm.cdf(b) - DELTA

    return optimize.brentq(excess, 0.0, 100.0, xtol=1e-12)


# q 0.05, sigma 1.5, 100 steps: 20 batches per epoch, 5 epochs
SHUFFLE = sampler_accounting("shuffle", 0.05, SIGMA, STEPS, DELTA)
POISSON_005 = poisson_pld(0.05)


def dataset(n: int = 200) -> TensorDataset:
    g = torch.Generator().manual_seed(n)
    return TensorDataset(torch.randn(n, 3, generator=g), torch.randint(0, 2, (n,), generator=g))


def make_private(loader, poisson_sampling: bool, model=None):
    model = model if model is not None else torch.nn.Linear(3, 2)
    engine = PrivacyEngine()
    return engine, engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=loader,
        noise_multiplier=SIGMA,
        max_grad_norm=1.0,
        poisson_sampling=poisson_sampling,
    )


def kinds(result) -> list[str]:
    return [f.kind for f in result.findings]


def only(result, kind: str) -> Finding:
    found = [f for f in result.findings if f.kind == kind]
    assert len(found) == 1, kinds(result)
    return found[0]


def test_reference_numbers_of_the_shuffle_example():
    # the numbers `privkit budget dpsgd --sampler shuffle` prints for this run
    assert sampler_accounting("poisson", 0.05, SIGMA, STEPS, DELTA).epsilon == pytest.approx(
        POISSON_005, rel=PLD_REL
    )
    assert round(sampler_accounting("poisson", 0.05, SIGMA, STEPS, DELTA).epsilon, 4) == 1.6716
    assert SHUFFLE.epsilon == pytest.approx(gaussian_exact(SIGMA / math.sqrt(5)), rel=1e-6)
    assert SHUFFLE.epsilon_lower == pytest.approx(3.8956, abs=1e-4)


@pytest.mark.parametrize("shuffle", [True, False])
def test_opacus_without_poisson_sampling_keeps_the_loader_and_accounts_poisson(shuffle):
    loader = DataLoader(dataset(), batch_size=10, shuffle=shuffle)
    engine, (model, optimizer, private_loader) = make_private(loader, poisson_sampling=False)
    assert private_loader is loader
    result = check_training(engine, model, optimizer, private_loader, delta=DELTA, steps=STEPS)
    assert kinds(result) == ["shuffle" if shuffle else "fixed_order", "secure_mode"]
    f = result.findings[0]
    assert f.changes_epsilon and result.exit_code == 1
    # opacus' accountant is fed 1 / len(loader) = 0.05 and would report Poisson's epsilon
    assert f.claimed_epsilon == pytest.approx(POISSON_005, rel=PLD_REL)
    assert f.epsilon_upper == pytest.approx(gaussian_exact(SIGMA / math.sqrt(5)), rel=1e-6)
    assert f.epsilon_lower == pytest.approx(SHUFFLE.epsilon_lower, rel=1e-12)
    assert "rate 0.05" in f.message and "1.672" in f.message and "6.999" in f.message
    assert "3.896" in f.message or not shuffle


def test_opacus_poisson_sampling_is_what_it_accounts_and_secure_mode_matters_for_release():
    loader = DataLoader(dataset(), batch_size=10, shuffle=True)
    engine, objects = make_private(loader, poisson_sampling=True)
    result = check_training(engine, *objects, delta=DELTA, steps=STEPS)
    secure = only(result, "secure_mode")
    assert kinds(result) == ["secure_mode"] and not secure.changes_epsilon
    assert result.exit_code == 0 and "Mironov 2012" in secure.message
    release = check_training(engine, *objects, delta=DELTA, steps=STEPS, release=True)
    assert release.exit_code == 1 and only(release, "secure_mode").changes_epsilon


def test_a_correct_configuration_gives_no_finding():
    poisson = DPDataLoader.from_data_loader(DataLoader(dataset(), batch_size=10))
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.GroupNorm(2, 4))
    result = check_training(
        model, poisson, delta=DELTA, steps=STEPS, noise_multiplier=SIGMA, sample_rate=0.05
    )
    assert result.findings == () and result.exit_code == 0
    assert result.verdict().startswith("verdict: no finding in 2 object(s)")
    ok = LocalDpMod(clipping_norm=1.0, sensitivity=2.0, epsilon=0.5, delta=DELTA)
    flower = check_training(ClientApp(mods=[recorded(ok)]), FedAvg(), delta=DELTA)
    assert flower.findings == () and flower.exit_code == 0


def test_weighted_random_sampler_has_no_sound_accountant():
    weights = torch.ones(200, dtype=torch.double)
    weights[0] = 100.0
    loader = DataLoader(dataset(), batch_size=10, sampler=WeightedRandomSampler(weights, 200))
    engine, objects = make_private(loader, poisson_sampling=False)
    f = only(check_training(engine, *objects, delta=DELTA, steps=STEPS), "with_replacement")
    assert f.changes_epsilon and f.epsilon_upper is None and f.epsilon_lower is None
    assert f.claimed_epsilon == pytest.approx(POISSON_005, rel=PLD_REL)
    share = 100.0 / 299.0
    p = 1 - (1 - share) ** 10  # the heaviest record in a batch of 10 draws with replacement
    assert f"{p:.4g}" in f.message and f"{p / 0.05:.3g}x the accounted rate 0.05" in f.message
    replaced = DataLoader(
        dataset(), batch_size=10, sampler=torch.utils.data.RandomSampler(dataset(), True)
    )
    g = only(check_training(replaced, delta=DELTA), "with_replacement")
    assert f"{1 - (1 - 1 / 200) ** 10:.4g}" in g.message and g.claimed_epsilon is None


def test_sample_rate_of_the_loader_against_the_accounted_rate():
    engine, (_, optimizer, _) = make_private(
        DataLoader(dataset(), batch_size=10), poisson_sampling=True
    )
    # the loader actually trained from draws batches of 20: rate 0.1, opacus accounts 0.05
    trained = DPDataLoader.from_data_loader(DataLoader(dataset(), batch_size=20))
    f = only(check_training(optimizer, trained, delta=DELTA, steps=STEPS), "sample_rate")
    assert f.changes_epsilon and "rate 0.1, above the rate 0.05" in f.message
    assert f.claimed_epsilon == pytest.approx(POISSON_005, rel=PLD_REL)
    assert f.epsilon_upper == pytest.approx(poisson_pld(0.1), rel=PLD_REL)
    # after a step, the engine's accountant history holds the rate too
    x, y = dataset()[:10]
    model = engine_model = torch.nn.Linear(3, 2)
    engine, (engine_model, optimizer, _) = make_private(
        DataLoader(dataset(), batch_size=10), True, model
    )
    torch.nn.functional.cross_entropy(engine_model(x), y).backward()
    optimizer.step()
    assert engine.accountant.history == [(SIGMA, 0.05, 1)]
    history = only(
        check_training(engine, trained, delta=DELTA, steps=STEPS, noise_multiplier=SIGMA),
        "sample_rate",
    )
    assert "accountant history" in history.message
    assert history.epsilon_upper == f.epsilon_upper
    # a rate the user states: below the loader's changes the epsilon, above it is conservative
    poisson = DPDataLoader.from_data_loader(DataLoader(dataset(), batch_size=10))
    low = only(
        check_training(poisson, delta=DELTA, steps=STEPS, noise_multiplier=SIGMA, sample_rate=0.01),
        "sample_rate",
    )
    assert low.changes_epsilon and low.claimed_epsilon == pytest.approx(
        poisson_pld(0.01), rel=PLD_REL
    )
    assert low.epsilon_upper == pytest.approx(POISSON_005, rel=PLD_REL)
    high = check_training(
        poisson, delta=DELTA, steps=STEPS, noise_multiplier=SIGMA, sample_rate=0.1
    )
    assert kinds(high) == ["sample_rate"] and high.exit_code == 0


def test_distributed_sampler_accounted_at_the_per_process_rate():
    data = dataset(400)
    sampler = DistributedSampler(data, num_replicas=2, rank=0, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=10, sampler=sampler)
    result = check_training(loader, delta=DELTA, steps=STEPS, noise_multiplier=SIGMA)
    assert kinds(result) == ["shuffle", "distributed"] and result.exit_code == 1
    f = only(result, "distributed")
    # per process: batch 10 of 400 (0.025); each of the 2 processes draws its own: 0.05 per step
    assert "rate per step is 0.05, 2x the per-process rate 0.025" in f.message
    assert f.claimed_epsilon == pytest.approx(poisson_pld(0.025), rel=PLD_REL)
    # 200 records per process, 20 batches per epoch: the shuffle bracket of q 0.05
    assert f.epsilon_upper == pytest.approx(SHUFFLE.epsilon, rel=1e-12)
    assert f.epsilon_lower == pytest.approx(SHUFFLE.epsilon_lower, rel=1e-12)


def test_epochs_give_the_steps_and_no_length_gives_no_epsilon():
    loader = DataLoader(dataset(), batch_size=10, shuffle=True)
    by_epochs = only(
        check_training(loader, delta=DELTA, epochs=5, noise_multiplier=SIGMA), "shuffle"
    )
    assert by_epochs.epsilon_lower == pytest.approx(SHUFFLE.epsilon_lower, rel=1e-12)
    unknown = only(check_training(loader, delta=DELTA), "shuffle")
    assert unknown.changes_epsilon and unknown.claimed_epsilon is None
    assert "give noise_multiplier and steps or epochs for the epsilons" in unknown.message


def test_noise_multiplier_the_accountant_uses_against_the_optimizers():
    _, objects = make_private(
        DPDataLoader.from_data_loader(DataLoader(dataset(), batch_size=10)), True
    )
    f = only(
        check_training(*objects, delta=DELTA, steps=STEPS, noise_multiplier=2.0), "noise_multiplier"
    )
    assert f.claimed_epsilon == pytest.approx(poisson_pld(0.05, sigma=2.0), rel=PLD_REL)
    assert f.epsilon_upper == pytest.approx(POISSON_005, rel=PLD_REL) and f.changes_epsilon


def test_batchnorm_is_a_cross_example_operation():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    f = only(check_training(model, delta=DELTA), "batchnorm")
    assert f.changes_epsilon and f.epsilon_upper is None and "1 (BatchNorm1d)" in f.message
    model[1].eval()  # running statistics only: each example is normalised alone
    assert check_training(model, delta=DELTA).findings == ()


def test_instance_norm_running_statistics_are_kept_unnoised():
    """InstanceNorm normalises each example alone, but with running statistics in training mode
    it keeps the batches' statistics in the model: no epsilon holds for the model released."""
    norm = torch.nn.InstanceNorm1d(4, track_running_stats=True)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Unflatten(1, (4, 2)), norm)
    f = only(check_training(model, delta=DELTA), "running_statistics")
    assert f.changes_epsilon and f.epsilon_upper is None and "2 (InstanceNorm1d)" in f.message
    assert check_training(model, delta=DELTA).exit_code == 1
    model.eval()  # normalised by the running statistics, which no longer move
    assert check_training(model, delta=DELTA).findings == ()
    model.train()
    norm.track_running_stats = False
    assert check_training(model, delta=DELTA).findings == ()


def test_flower_local_dp_mod_and_strategies():
    mod = LocalDpMod(clipping_norm=1.0, sensitivity=1.0, epsilon=10.0, delta=DELTA)
    result = check_training(mod, delta=DELTA)
    assert kinds(result) == ["flower_sensitivity", "flower_classic_formula"]
    std = math.sqrt(2 * math.log(1.25 / DELTA)) / 10.0  # Flower's classic formula
    exact = float(dpa.gaussian_mechanism.get_epsilon_gaussian(std / 2.0, DELTA))  # 2C replace-one
    for f in result.findings:
        assert f.claimed_epsilon == 10.0 and f.changes_epsilon
        assert f.epsilon_upper == pytest.approx(exact, rel=1e-6)
    assert exact == pytest.approx(25.44, abs=5e-3) and "25.44" in result.findings[1].message
    # the same mod inside a ClientApp, beside a plain FedAvg: the clients add the noise
    app = check_training({"client": ClientApp(mods=[mod]), "server": FedAvg()}, delta=DELTA)
    assert kinds(app) == ["flower_sensitivity", "flower_classic_formula"]
    assert app.findings[0].message.startswith("client: ")
    # FedAvg alone: rounds without noise
    plain = only(check_training(FedAvg(), delta=DELTA), "flower_no_noise")
    assert plain.changes_epsilon and plain.epsilon_upper == math.inf


def test_flower_adaptive_clipping_under_zero_out():
    ada = DifferentialPrivacyClientSideAdaptiveClipping(
        FedAvg(), noise_multiplier=1.0, num_sampled_clients=20
    )
    assert check_training(ada, delta=DELTA).findings == ()  # replace-one: exactly z/2
    f = only(check_training(ada, delta=DELTA, neighbouring="add_remove"), "flower_adaptive_count")
    z_u = (1.0 - 0.25) ** -0.5  # Flower's update multiplier; the uncentred bit moves the count by 1
    real = (z_u**-2 + 1.0) ** -0.5
    assert f.claimed_epsilon == pytest.approx(gaussian_exact(1.0), rel=1e-6)
    assert f.epsilon_upper == pytest.approx(gaussian_exact(real), rel=1e-6) and f.changes_epsilon


def test_bad_input_names_the_parameter_and_the_value():
    loader = DataLoader(dataset(), batch_size=10)
    with pytest.raises(ValueError, match=r"delta must be in \(0, 1\); found 1.5"):
        check_training(loader, delta=1.5)
    with pytest.raises(ValueError, match=r"found steps=10 and epochs=2"):
        check_training(loader, delta=DELTA, steps=10, epochs=2)
    with pytest.raises(ValueError, match=r"sample_rate must be in \(0, 1\]; found 2.0"):
        check_training(loader, delta=DELTA, sample_rate=2.0)
    with pytest.raises(ValueError, match=r"found int as answer"):
        check_training({"answer": 42}, delta=DELTA)
    with pytest.raises(ValueError, match="message must be one line"):
        Finding("x", "two\nlines", False)


# ----------------------------------------------------------------------------- the CLI
SCRIPT = """
import torch
from torch.utils.data import DataLoader, TensorDataset
from opacus import PrivacyEngine

g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(200, 3, generator=g), torch.randint(0, 2, (200,), generator=g))
test_loader = DataLoader(TensorDataset(torch.randn(50, 3), torch.zeros(50).long()), batch_size=50)
loader = DataLoader(data, batch_size=10, shuffle=True)
model = torch.nn.Linear(3, 2)
engine = PrivacyEngine()
model, optimizer, loader = engine.make_private(
    module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=loader,
    noise_multiplier=1.5, max_grad_norm=1.0, poisson_sampling={poisson},
)
print("this goes to stderr")

def training_objects():
    return engine, model, optimizer, loader

if __name__ == "__main__":
    raise SystemExit("the training must not run")
"""


def privkit_check(capsys, *args: str) -> tuple[int, list[str], str]:
    with pytest.raises(SystemExit) as exit_info, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        main(["check", *args])
    out, err = capsys.readouterr()
    return exit_info.value.code, out.splitlines(), err


@pytest.fixture
def scripts(tmp_path):
    out = {}
    for name, poisson in (("shuffled", False), ("poisson", True)):
        out[name] = tmp_path / f"{name}.py"
        out[name].write_text(textwrap.dedent(SCRIPT.format(poisson=poisson)))
    return out


def test_cli_exit_1_one_line_per_finding(scripts, capsys):
    code, lines, err = privkit_check(
        capsys, str(scripts["shuffled"]), "--delta", "1e-5", "--steps", "100"
    )
    assert code == 1 and len(lines) == 3, lines
    assert lines[0].startswith("shuffle: loader: shuffled fixed-size batches")
    assert f"claims epsilon {POISSON_005:.4g}" in lines[0]
    assert (
        f"epsilon <= {SHUFFLE.epsilon:.4g} (>= {SHUFFLE.epsilon_lower:.4g} certified)" in lines[0]
    )
    assert lines[1].startswith("secure_mode: engine, optimizer:")
    assert lines[2] == (
        "verdict: 2 finding(s) in 4 object(s), 1 changes the epsilon: the claimed epsilon does not hold"
    )
    assert "this goes to stderr" in err and "skipped: test_loader" in err


def test_cli_exit_0_and_release_with_call(scripts, capsys):
    args = (
        str(scripts["poisson"]),
        "--call",
        "training_objects",
        "--delta",
        "1e-5",
        "--epochs",
        "5",
    )
    code, lines, _ = privkit_check(capsys, *args)
    assert code == 0 and [line.split(":")[0] for line in lines] == ["secure_mode", "verdict"]
    assert lines[1].endswith("none changes the epsilon")
    code, lines, _ = privkit_check(capsys, *args, "--release")
    assert code == 1 and "the model is for release" in lines[0]
    code, lines, _ = privkit_check(capsys, *args, "--json")
    data = json.loads("\n".join(lines))
    assert code == 0 and [f["kind"] for f in data["findings"]] == ["secure_mode"]
    assert data["exit_code"] == 0 and data["skipped"] == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--delta", "1.5"), "error: --delta must be in (0, 1); found 1.5"),
        (
            ("--delta", "1e-5", "--steps", "1.5"),
            "error: --steps must be an integer >= 1; found '1.5'",
        ),
        (("--delta", "1e-5", "--call", "nothing"), "error: --call must name a function of"),
    ],
)
def test_cli_exit_2_one_line(scripts, capsys, args, message):
    code, lines, err = privkit_check(capsys, str(scripts["poisson"]), *args)
    error_lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and lines == [] and len(error_lines) == 1
    assert error_lines[0].startswith(message)


def test_cli_exit_2_for_a_failing_script(tmp_path, capsys):
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('no data here')\n")
    code, _, err = privkit_check(capsys, str(broken), "--delta", "1e-5")
    assert code == 2 and f"error: SCRIPT {broken} raised RuntimeError: no data here" in err
    empty = tmp_path / "empty.py"
    empty.write_text("x = 1\n")
    code, _, err = privkit_check(capsys, str(empty), "--delta", "1e-5")
    assert code == 2 and "found none in" in err
