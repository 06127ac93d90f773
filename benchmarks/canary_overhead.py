"""What white-box gradient canaries add to a DP-SGD step (issue 32, item 2: at most 10% over the
step without them).

One privkit DP-SGD step (:meth:`privkit.mechanisms.dp_sgd_step.DpSgdStep.noisy_gradient`: clipped
sum, canaries, release noise) on two models, batch 64 of 32x32x3 inputs, 10 classes:

* ``resnet_gn``: a small ResNet with GroupNorm (three stages, 85k parameters);
* ``mlp``: 3072-512-512-10 (1.84M parameters: a dimension where a dense per-step vector shows);
* ``resnet18`` (with ``--models``): ResNet-18 with GroupNorm, 11.2M parameters (for a GPU).

For each model, with 0, 500 and 1000 Dirac canaries (:class:`attacks.whitebox.GradientCanaries`,
256 witnesses), through the canaries' ``sparse`` path (what privkit runs: the sampled canaries added
in place at their own coordinates on the tensors' device and put back after the release, the
release read at the reserved coordinates only, and for the noise scale one read of at most
``attacks.whitebox.NOISE_READ`` coordinates, a rotating share of a longer release's blocks: on
the CPU in chunks through a cached buffer, no tensor-sized temporary), ``full-read`` (the same
with the whole release read for the noise scale every step, as before the share: the
``noise_read=dim`` knob) and the ``dense`` path it replaced (the ``vector`` of every coordinate built and added to every
parameter each step, the whole release and clean sum copied to the host in float64), in release
mode (``DpRandom.secret``: the grid's exact noise) and with a seeded torch generator (``seeded``:
cheaper noise, so the canaries' share of the step is larger). Every configuration runs once per
round, rounds interleaved (order shuffled each round), after warm-up. On the CPU each call is timed
by this thread's CPU time (one torch thread does all the work; other processes on a shared machine
stretch the wall clock, not it), on a GPU by the synchronised wall clock; ``median_ms`` (wall) and
``median_cpu_ms`` are medians over ``--repeats`` rounds, and ``overhead`` is the median over rounds
of the configuration's time over the same round's time of the same model and noise without
canaries, minus 1 (``overhead_wall``: the same on the wall clock). ``canary_ops_ms`` times the
canaries' own work alone (adding them, putting them back, ``observe``) on the model's gradient
tensors, median of 50, for each path.

    OMP_NUM_THREADS=1 python benchmarks/canary_overhead.py --json [--device cpu|cuda] [--repeats 15]
        [--paths sparse,full-read,dense] [--replay]

(``--replay``: every configuration's clipped sum replayed by a ``StepReplay``, so that the
canaries are weighed against a step whose host work is its operations, as on a GPU they would
be with it.)

(``--opacus``: also opacus' ghost-clipping step, its own noise, with the auditor's canaries
inserted by ``attach_to_opacus`` without a loader, path ``inject``, and the same with the dense
``inject`` it replaced, ``inject-dense``: the clean sum copied whole and the dense vector added
to every tensor each step.)

(``--paths sparse,full-read`` leaves out the dense path, whose 15-30 MB host copies a step also
churn the allocator under the configurations timed after them.)

With ``--json`` one JSON object is printed (recorded in benchmarks/results/canary_overhead_cpu.json,
one torch thread; ``canary_overhead_cuda.json``: ``--device cuda --models resnet_gn,mlp,resnet18``
on an NVIDIA H200, where every tensor, the model and the release noise live on the device and
each timing synchronises it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import time

import torch
import torch.nn.functional as F
from torch import nn

from attacks.whitebox import GradientCanaries, _pieces, joined_on
from privkit.mechanisms.dp_random import DpRandom
from privkit.mechanisms.dp_sgd_step import DpSgdStep
from privkit.mechanisms.step_replay import StepReplay

SCHEMA_VERSION = 1
BATCH = 64
DATASET = 6400  # expected batch q n = 64


class Block(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.c1, self.n1 = nn.Conv2d(c, c, 3, padding=1), nn.GroupNorm(4, c)
        self.c2, self.n2 = nn.Conv2d(c, c, 3, padding=1), nn.GroupNorm(4, c)

    def forward(self, x):
        return F.relu(x + self.n2(self.c2(F.relu(self.n1(self.c1(x))))))


def resnet_gn() -> nn.Module:
    """Stem 3->16, a residual block at 16, 32 and 48 channels (stride-2 convolutions between),
    global average pooling, linear head: 85k parameters."""

    def down(i: int, o: int) -> list[nn.Module]:
        return [nn.Conv2d(i, o, 3, stride=2, padding=1), nn.GroupNorm(4, o), nn.ReLU()]

    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.GroupNorm(4, 16),
        nn.ReLU(),
        Block(16),
        *down(16, 32),
        Block(32),
        *down(32, 48),
        Block(48),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(48, 10),
    )


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(3072, 512),
        nn.ReLU(),
        nn.Linear(512, 512),
        nn.ReLU(),
        nn.Linear(512, 10),
    )


def resnet18() -> nn.Module:
    """ResNet-18 with GroupNorm (11.2M parameters): ``dpsgd_step.py --big``'s model, for a GPU."""
    from dpsgd_step import build  # this folder is on sys.path when a benchmark runs as a script

    return build("resnet18")[0]


MODELS = {"resnet_gn": resnet_gn, "mlp": mlp, "resnet18": resnet18}


def _loss(logits, target, aux):
    return F.cross_entropy(logits, target)


class DenseCanaryStep(DpSgdStep):
    """The step as it was before sparse canaries: the dense ``vector`` added to every slice
    (new tensors in ``total``; nothing to take out after the release)."""

    def _with_canaries(self, total, names, canaries, source):
        ids = canaries.included_ids
        sampled = source.mask(len(ids), rate=self.sample_rate).to(torch.float32)
        raw = torch.full((len(ids),), canaries.raw_norm)
        add = canaries.vector(sampled * self.clip_factor(raw) * raw)
        at = 0
        for k in names:
            t = total[k]
            total[k] = t + add[at : at + t.numel()].reshape(t.shape).to(
                device=t.device, dtype=t.dtype
            )
            at += t.numel()
        return lambda: None

    def _joined_with_canaries(self, total, names, canaries, source):
        # off the CPU too, the dense vector added to every slice (the path being compared)
        total = dict(total)
        return total, self._with_canaries(total, names, canaries, source)


def dense_observer(can: GradientCanaries) -> GradientCanaries:
    """``can`` observing as before: the whole release and clean sum on the host, in float64;
    and injecting as before (:func:`dense_injector`)."""
    can._observe_sparse = lambda released, base, scale, share, dense: can._observe_dense(
        released, base, scale, share
    )
    return dense_injector(can)


def dense_injector(can: GradientCanaries) -> GradientCanaries:
    """``can`` injecting as before its sparse ``inject``: the clean sum copied whole, the dense
    vector added to every tensor (in place, as opacus' wrapper added it: ``after - before``)."""

    def inject(summed, *, in_place=False):
        out = _dense_inject(summed)
        if in_place:
            for t, after in zip(_pieces(summed), _pieces(out)):
                if after is not t:
                    t.add_(after - t)
            return summed
        return out

    def _dense_inject(summed):
        if can._pending:
            raise RuntimeError("inject called twice without observe")
        flat = torch.cat([t.detach().reshape(-1) for t in _pieces(summed)])
        can._clean = flat.clone() if can.know_batch else None
        sampled = (torch.rand(can.n, generator=can._sampling) < can.sample_rate) & can._inc
        can.appearances += sampled.numpy()
        can._pending = True
        if not bool(sampled.any()):
            return summed
        vec = can._direction_sum(sampled.to(torch.float32))
        add = vec.to(device=flat.device, dtype=flat.dtype) * can.clip_norm
        if isinstance(summed, torch.Tensor):
            return summed + add.reshape(summed.shape)
        out, at = [], 0
        for t in summed:
            out.append(t + add[at : at + t.numel()].reshape(t.shape))
            at += t.numel()
        return out

    can.inject = inject
    return can


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _canaries(model: nn.Module, n: int, path: str) -> GradientCanaries | None:
    if n == 0:
        return None
    dim = sum(p.numel() for p in model.parameters())
    can = GradientCanaries(
        dim,
        n,
        clip_norm=1.0,
        sample_rate=BATCH / DATASET,
        noise_multiplier=1.0,
        noise_read=dim if path in ("full-read", "dense") else None,
    )
    return dense_observer(can) if path == "dense" else can


PATHS = {"sparse": DpSgdStep, "full-read": DpSgdStep}  # and "dense": DenseCanaryStep, below


def canary_ops_ms(
    model: nn.Module, n: int, device: torch.device, reps: int = 50, paths=("sparse", "dense")
) -> dict:
    """The canaries' own work per step on the model's gradient shapes (median ms), per path."""
    grads = [torch.randn_like(p) for p in model.parameters()]
    names = [str(i) for i in range(len(grads))]
    total = dict(zip(names, grads))
    out = {}
    for path in paths:
        step_cls = DenseCanaryStep if path == "dense" else PATHS[path]
        step = step_cls(1.0, 1.0, 0.5, DATASET)  # rate 0.5: about a quarter of the canaries added
        can = _canaries(model, n, path)
        src = DpRandom(torch.Generator().manual_seed(0))
        times = []
        clock = time.thread_time if device.type == "cpu" else time.perf_counter
        for i in range(reps + 3):
            tot = dict(total)
            _sync(device)
            start = clock()
            if joined_on(device):  # as the step adds them there (DpSgdStep.noisy_gradient)
                tot, restore = step._joined_with_canaries(tot, names, can, src)
            else:
                restore = step._with_canaries(tot, names, can, src)
            _sync(device)
            mid = clock() - start
            released = [tot[k].clone() for k in names]  # stands for the release (not timed)
            _sync(device)
            start = clock()
            restore()
            can.observe(released, clean=grads)
            _sync(device)
            if i >= 3:
                times.append(mid + clock() - start)
        out[path] = 1e3 * statistics.median(times)
    return out


def opacus_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, n: int, path: str):
    """One step of opacus' ghost clipping (its own noise) on a copy of ``model``, with ``n``
    auditor's canaries (:func:`attacks.whitebox.attach_to_opacus` without a loader; ``path``
    ``inject-dense``: the dense inject it replaced)."""
    import copy
    import warnings

    from opacus import PrivacyEngine
    from opacus.validators import ModuleValidator

    from attacks.whitebox import attach_to_opacus

    m = ModuleValidator.fix(copy.deepcopy(model))
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x.cpu(), y.cpu()), batch_size=len(y)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gm, go, crit, _ = PrivacyEngine(accountant="rdp").make_private(
            module=m,
            optimizer=torch.optim.SGD(m.parameters(), lr=0.01),
            criterion=nn.CrossEntropyLoss(),
            data_loader=loader,
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            poisson_sampling=False,
            grad_sample_mode="ghost",
        )
    can = _canaries(gm, n, "sparse")
    if can is not None:
        attach_to_opacus(go, dense_injector(can) if path == "inject-dense" else can)

    def run():
        go.zero_grad(set_to_none=True)
        crit(gm(x), y).backward()
        go.step()

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    ap.add_argument("--repeats", type=int, default=15, help="interleaved rounds (default 15)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    ap.add_argument("--canaries", default="0,500,1000")
    ap.add_argument("--models", default="resnet_gn,mlp")
    ap.add_argument("--paths", default="sparse,full-read,dense", help="canary paths to time")
    ap.add_argument(
        "--replay",
        action="store_true",
        help="every step's clipped sum replayed (StepReplay): the canaries against a step whose "
        "host work is its operations",
    )
    ap.add_argument(
        "--opacus",
        action="store_true",
        help="add opacus' ghost-clipping step with the auditor's canaries (attach_to_opacus "
        "without a loader: inject, and the dense inject it replaced)",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    counts = [int(c) for c in args.canaries.split(",")]
    paths = args.paths.split(",")
    unknown = [p for p in paths if p not in (*PATHS, "dense")]
    if unknown:
        ap.exit(2, f"--paths must name sparse, full-read or dense; found {unknown[0]!r}\n")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH, 3, 32, 32, generator=g).to(device)
    y = torch.randint(0, 10, (BATCH,), generator=g).to(device)

    configs = []  # (model, noise, canaries, path)
    state = {}
    for name in args.models.split(","):
        torch.manual_seed(0)
        model = MODELS[name]().to(device)
        state[name] = model
        for noise in ("release", "seeded"):
            for n in counts:
                for path in paths if n else ("none",):
                    configs.append((name, noise, n, path))
        if args.opacus:
            for n in counts:
                for path in ("inject", "inject-dense") if n else ("none",):
                    configs.append((name, "opacus", n, path))
    runners = {}
    for cfg in configs:
        name, noise, n, path = cfg
        model = state[name]
        if noise == "opacus":
            runners[cfg] = opacus_step(model, x, y, n, path)
            continue
        step = (DenseCanaryStep if path == "dense" else DpSgdStep)(
            1.0, 1.0, BATCH / DATASET, DATASET
        )
        src = (
            DpRandom.secret(device)
            if noise == "release"
            else DpRandom(torch.Generator(device=device).manual_seed(1), device)
        )
        can = _canaries(model, n, path)
        replay = StepReplay() if args.replay else None

        def run(model=model, step=step, src=src, can=can, replay=replay):
            step.noisy_gradient(model, x, y, _loss, src, canaries=can, replay=replay)

        runners[cfg] = run
    for run in runners.values():  # warm-up (a replay's first step, recording, checked replay)
        for _ in range(3):
            run()
    times: dict = {cfg: [] for cfg in configs}  # (wall s, this thread's CPU s) per round
    order = list(configs)
    rng = random.Random(0)
    load_before = os.getloadavg()
    for _ in range(args.repeats):
        rng.shuffle(order)
        for cfg in order:
            _sync(device)
            start, cpu = time.perf_counter(), time.thread_time()
            runners[cfg]()
            _sync(device)
            times[cfg].append((time.perf_counter() - start, time.thread_time() - cpu))
    # on the CPU the clock is this thread's CPU time (other processes on the machine stretch the
    # wall clock, not it); on a GPU the wall clock, synchronised
    clock = 1 if device.type == "cpu" else 0

    def overhead(cfg, base, c: int) -> float:
        """Median over rounds of the configuration's time over the same round's base, minus 1."""
        return statistics.median(a[c] / b[c] for a, b in zip(times[cfg], times[base])) - 1

    rows = []
    for cfg in configs:
        name, noise, n, path = cfg
        base = (name, noise, 0, "none") if 0 in counts else None
        walls, cpus = [t[0] for t in times[cfg]], [t[1] for t in times[cfg]]
        rows.append(
            {
                "model": name,
                "noise": noise,
                "canaries": n,
                "path": path,
                "median_ms": round(1e3 * statistics.median(walls), 3),
                "median_cpu_ms": round(1e3 * statistics.median(cpus), 3),
                "overhead": None if base is None else round(overhead(cfg, base, clock), 4),
                "overhead_wall": None if base is None else round(overhead(cfg, base, 0), 4),
                "times_ms": [round(1e3 * t, 3) for t in walls],
                "cpu_times_ms": [round(1e3 * t, 3) for t in cpus],
            }
        )
    ops = {
        name: {str(n): canary_ops_ms(state[name], n, device, paths=paths) for n in counts if n}
        for name in state
    }
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
        ).stdout.strip()
    except OSError:
        commit = None
    out = {
        "schema_version": SCHEMA_VERSION,
        "benchmark": "canary_overhead",
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "cpu_count": os.cpu_count(),
        "commit": commit,
        "batch": BATCH,
        "replay": args.replay,
        "parameters": {name: sum(p.numel() for p in m.parameters()) for name, m in state.items()},
        "repeats": args.repeats,
        "clock": "thread CPU time" if clock else "wall (synchronised)",
        "loadavg_before_after": [load_before[0], os.getloadavg()[0]],
        "witness": 256,
        "rows": rows,
        "canary_ops_ms": ops,
        "goal": "overhead <= 0.10 (sparse path)",
        "max_sparse_overhead": max(
            (r["overhead"] for r in rows if r["path"] == "sparse" and r["overhead"] is not None),
            default=None,
        ),
    }
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        for r in rows:
            ov = "" if r["overhead"] is None else f"{100 * r['overhead']:+6.1f}%"
            print(
                f"{r['model']:10s} {r['noise']:8s} {r['canaries']:5d} {r['path']:6s} "
                f"{r['median_ms']:9.2f} ms (cpu {r['median_cpu_ms']:9.2f} ms) {ov}"
            )
        print("canary ops (ms):", json.dumps(ops))


if __name__ == "__main__":
    main()
