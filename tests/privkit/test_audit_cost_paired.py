"""benchmarks/audit_cost_paired.py: the paired before/after summary and its bad input."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import audit_cost_paired


def _side(train: float, audit: float) -> dict:
    return {"methods": {"m": {"train_cpu_s": train, "audit_cpu_s": audit}}, "conditions": {}}


def test_the_summary_pools_the_trainings_and_pairs_the_audits():
    pairs = [
        {"before": _side(2.0, 10.0), "after": _side(3.0, 8.0)},
        {"before": _side(4.0, 12.0), "after": _side(2.5, 9.0)},
        {"before": _side(3.5, 11.0), "after": _side(2.2, 10.0)},
    ]
    s = audit_cost_paired.summarise(pairs)["m"]
    assert s["audit_cpu_s_before"] == [10.0, 12.0, 11.0]
    assert s["audit_cpu_s_after"] == [8.0, 9.0, 10.0]
    # the pairs' changes -20%, -25%, -9.1%: their median
    assert s["audit_change_median_of_pairs"] == pytest.approx(-0.2)
    assert s["train_cpu_s_all"] == [2.0, 3.0, 4.0, 2.5, 3.5, 2.2]
    assert s["train_cpu_s_median"] == pytest.approx(2.75)  # of all six trainings
    assert s["ratio_before_median_audit_over_median_train"] == pytest.approx(11.0 / 2.75)
    assert s["ratio_after_median_audit_over_median_train"] == pytest.approx(round(9.0 / 2.75, 2))


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--before", "no-such-revision"],
            "--before must name a commit of this repository; found 'no-such-revision'",
        ),
        (["--before", "HEAD", "--pairs", "0"], "--pairs must be an integer >= 1; found 0"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        audit_cost_paired.main(argv)
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip() == message


def test_the_matrix_product_rate_is_flops_over_the_best_time(monkeypatch):
    """audit_cost.py's machine rate: 2 n^3 flops over the fastest of the timed products (the
    warm-up untimed), on one thread, the caller's thread count restored."""
    import audit_cost
    import torch

    ticks = iter([0.0, 0.5, 1.0, 1.25, 2.0, 3.0])  # products of 0.5 s, 0.25 s, 1.0 s
    monkeypatch.setattr(audit_cost.time, "process_time", lambda: next(ticks))
    seen = []
    real_mm = torch.mm
    monkeypatch.setattr(
        torch, "mm", lambda a, b: seen.append(torch.get_num_threads()) or real_mm(a, b)
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the caller's: one thread while timing, two again after
    try:
        got = audit_cost.matmul_gflops(size=8, repeats=3)
        assert seen == [1, 1, 1, 1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    assert got == pytest.approx(2 * 8**3 / 0.25 / 1e9)


@pytest.mark.parametrize("config, extra", [("quick", []), ("default", ["--config", "default"])])
def test_each_process_runs_the_configuration_asked_for(config, extra, monkeypatch, tmp_path):
    """``--config default`` reaches every ``audit_cost.py`` process; the quick configurations add
    no option, so a revision from before ``audit_cost.py --config`` runs as it did."""
    seen = []

    class Done:
        stdout = '{"methods": {}, "conditions": {}}'

    def fake_run(cmd, **kwargs):
        seen.append((cmd, kwargs["cwd"]))
        return Done()

    monkeypatch.setattr(audit_cost_paired.subprocess, "run", fake_run)
    audit_cost_paired._run(tmp_path, "dpsgd", config)
    cmd, cwd = seen[0]
    assert cwd == tmp_path
    assert cmd[-len(extra) - 2 :] == ["--methods", "dpsgd", *extra]


def test_rounds_run_this_checkouts_measurement_in_both_trees(monkeypatch, tmp_path):
    """``--rounds N`` reaches each process, which runs this checkout's ``audit_cost.py`` (an
    earlier one has no ``--rounds``) on the tree's own code (its path first)."""
    seen = []

    class Done:
        stdout = '{"methods": {}, "conditions": {}}'

    def fake_run(cmd, **kwargs):
        seen.append((cmd, kwargs["cwd"], kwargs["env"]["PYTHONPATH"]))
        return Done()

    monkeypatch.setattr(audit_cost_paired.subprocess, "run", fake_run)
    audit_cost_paired._run(tmp_path, "fedmd-np", "default", 2)
    cmd, cwd, path = seen[0]
    assert cwd == tmp_path and path == str(tmp_path)
    assert cmd[1] == str(audit_cost_paired.ROOT / "benchmarks" / "audit_cost.py")
    assert cmd[-4:] == ["--config", "default", "--rounds", "2"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--methods", "fedavg,dpsgd", "--rounds", "2"],
            "--rounds applies to federated methods; found dpsgd, which has no rounds",
        ),
        (["--methods", "fedavg", "--rounds", "-1"], "--rounds must be an integer >= 0; found -1"),
    ],
)
def test_audit_cost_rounds_bad_input_is_one_line_and_exit_code_2(argv, message, capsys):
    import audit_cost

    with pytest.raises(SystemExit) as exit_:
        audit_cost.main(argv)
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip() == message


def test_audit_cost_rounds_set_each_runs_configuration(monkeypatch):
    """``--rounds`` replaces the configuration's rounds in the training and in its audit (the run
    directory's config is the trained one)."""
    import audit_cost

    seen = []

    class Stop(Exception):
        pass

    def fake_train(method, fed, cfg, seed):
        seen.append(cfg)
        raise Stop

    import privkit.flower_engine.engine as engine

    monkeypatch.setattr(engine, "train", fake_train)
    monkeypatch.setattr(audit_cost, "_WARM", ["fedavg"])
    monkeypatch.setattr(audit_cost, "_federation", lambda: None)
    task = {"method": "fedavg", "seed": 0, "shadows": 2, "delta": 1e-5, "config": "default"}
    with pytest.raises(Stop):
        audit_cost.measure({**task, "rounds": 3})
    with pytest.raises(Stop):
        audit_cost.measure(task)
    from privkit.trainers import REGISTRY

    assert (
        seen[0]["rounds"] == 3 and seen[1]["rounds"] == REGISTRY["fedavg"].defaults()["rounds"] != 3
    )
    assert {k: v for k, v in seen[0].items() if k != "rounds"} == {
        k: v for k, v in seen[1].items() if k != "rounds"
    }
