"""Centralised DP-SGD runs batched (:mod:`privkit.batched.many`): opacus' mechanism, opacus' streams.

``train("dpsgd", ...)`` runs opacus (:func:`privkit.trainers.dpsgd.train_dpsgd`). Its batched form
runs the same mechanism for many runs in lock-step on stacked models, and draws from each run's
streams exactly what opacus draws from them, in the same order, so that in reproducible-noise mode
each run's weights are opacus' up to float rounding:

* batches (the ``poisson`` stream): per epoch, the DataLoader iterator's base seed (one int64 drawn
  from the loader's generator), then per step one ``rand(n) < q`` mask
  (``UniformWithReplacementSampler``), ``ceil(n / batch_size)`` steps, ``q`` their inverse;
* per-example gradients clipped by opacus' rule ``min(1, C / (norm + 1e-6))`` (norms and the clipped
  sum from each layer's inputs and output gradients, :class:`~privkit.mechanisms.stacked.
  StackedModels`, where opacus forms every per-example gradient);
* noise (the ``noise`` stream): per parameter in the optimiser's order, ``normal(0, sigma C)`` of its
  shape; the sum of the clipped gradients and the noise divided by opacus' expected batch size
  ``int(n q)``; one step of SGD;
* the ledger: each release's receipt (the primitive's, Poisson subsampled at ``q`` as opacus'
  steps state it) kept per run and composed by the single run's :func:`~privkit.trainers.dpsgd.
  dpsgd_result`, as the single run composes opacus' steps' receipts.

In release mode the streams are fresh secret ones drawn as :mod:`privkit.mechanisms.opacus_streams`
draws them. Adam is not batched (it amplifies the float rounding by which the batched gradients
differ from opacus', :mod:`privkit.batched.exact_mlp`): those runs train one after the other.

An audit's reference runs (``fast``) take every epoch's row but evaluate only the last epoch's
test accuracy (the others are a report's, which never reads a reference run:
:func:`~privkit.batched.many.unreported`); their models, losses and ledgers are unchanged.
The seeded reference runs draw a step's Poisson batches together, one draw of uniforms from the
first one's batch stream (:class:`~privkit.batched.many.JointSampling`: each run's law, not its
stream's numbers), as they draw their noise together (:func:`~privkit.batched.many.joint_release`).
With seeded reference runs in the stack, every run steps over the inputs some record uses
(:class:`~privkit.batched.used_inputs.UnusedInputs`): the target run still releases its whole
gradient at every step, and a reference run draws its other inputs' weights' noise of all its
steps after its last one (the same law; its numbers, not its receipts, change).

Audits reach the batched runs as they reach opacus' (:func:`privkit.trainers.dpsgd.
_take_probes_and_mutation`): inside an audit's probing block each run's pooled mechanism takes
one probe set per probed client (:func:`~privkit.trainers.dpsgd.probe_sets`), sampled from the
run's noise stream before its noise, clipped by opacus' rule, added before the release and
observing it (:class:`~privkit.trainers.dpsgd.ProbedStep`, the single run's own code); an audit's
mutation switches the clipping off here (records and canaries alike) and scales the noise in the
release primitive.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from attacks.transfers import to_device
from privkit.batched.batched_sgd import load_states
from privkit.batched.buffers import kept
from privkit.batched.class_axis import cross_entropy
from privkit.batched.many import (
    JointSampling,
    batch_positions,
    joint_release,
    round_done,
    rows_of,
    stacked_on,
    unreported,
)
from privkit.batched.used_inputs import UnusedInputs
from privkit.mechanisms import mutations
from privkit.mechanisms.gaussian import Receipt, gaussian_release
from privkit.mechanisms.stacked import StackedModels
from privkit.seeding import derive_seed, noise_generator
from privkit.trainers.common import accuracy, new_model, resolve_device
from privkit.trainers.dpsgd import ProbedStep, _plan, dpsgd_result, probe_sets

OPACUS_NORM_OFFSET = 1e-6  # opacus' DPOptimizer.clip_and_accumulate: C / (norm + 1e-6)


class _Run:
    """One run's data, plan, streams and bookkeeping."""

    def __init__(self, federation, config, seed: int, device: torch.device):
        self.federation, self.seed, self.config = federation, seed, config
        # its records: the pooled order's (Federation.pooled_arrays), gathered from _Records
        self.members = federation.members
        self.n = len(self.members)
        self.plan = _plan(federation, config)
        self.rate, self.steps, self.sigma, _ = self.plan
        self.per_epoch = round(1 / self.rate)
        self.expected = int(self.n * self.rate)  # opacus: int(len(dataset) * sample_rate)
        self.model, self.spec = new_model(federation, config, derive_seed(seed, "init"))
        self.batches = noise_generator(seed, "poisson", reproducible=config.reproducible_noise)
        self.noise = noise_generator(
            seed, "noise", reproducible=config.reproducible_noise, device=device
        )
        dim = sum(int(p.numel()) for p in self.model.parameters() if p.requires_grad)
        self.probes = probe_sets(
            dim, federation.num_clients, config.clip_norm, self.rate, self.sigma
        )
        self.rounds: list[dict] = []
        self.seen = 0  # examples since the last epoch row (their summed loss: loss_sums)
        # an audit's reference run (many.unreported) evaluates its last epoch only
        self.report_metrics = True
        self.receipts: list[Receipt] = []  # each release's, for the ledger (dpsgd_result)

    def batch(self, t: int) -> torch.Tensor:
        """Step ``t``'s Poisson batch (record indices), drawn as opacus' loader draws it."""
        if (
            t % self.per_epoch == 0 and self.batches.seeded_torch
        ):  # a new DataLoader iterator's base seed
            torch.empty((), dtype=torch.int64).random_(generator=self.batches.source)  # type: ignore[arg-type]  # seeded_torch: a torch Generator
        return torch.nonzero(self.batches.mask(self.n, rate=self.rate)).flatten()

    def noisy(
        self, sums: dict[str, torch.Tensor], std: float, clip: float
    ) -> dict[str, torch.Tensor]:
        """The step's summed gradients plus noise, drawn as the single run's optimizer draws it:
        privkit's release primitive over the parameters in opacus' order
        (:func:`privkit.mechanisms.gaussian_release`, sensitivity ``clip``, Poisson rate the
        plan's); its receipt goes to :attr:`receipts`."""
        names = list(sums)  # opacus' parameter order, as its add_noise draws
        noisy, receipt = gaussian_release(
            [sums[k] for k in names],
            std=std,
            sensitivity=clip,
            source=self.noise,
            sample_rate=self.rate,
        )
        self.receipts.append(receipt)
        return dict(zip(names, noisy))


def _test_accuracy(r: _Run, weights: dict[str, torch.Tensor], device: torch.device) -> float:
    """Run ``r``'s test accuracy with its parameters as they are (``weights``)."""
    r.model.load_state_dict({k: v.detach().clone() for k, v in weights.items()}, strict=False)
    return accuracy(r.model, *r.federation.test_arrays(), device)  # type: ignore[call-arg]  # test_arrays is (x, y)


def _narrowed(
    runs: list[_Run],
    quick: list[bool],
    net: StackedModels,
    params: dict[str, torch.Tensor],
    records: _Records,
    device: torch.device,
) -> UnusedInputs | None:
    """With seeded reference runs (``quick``) in the stack, the stack over the inputs some
    record uses (:class:`~privkit.batched.used_inputs.UnusedInputs`: the others' weights are
    never read, and a reference run draws their noise after its last step), ``params`` and the
    ``records`` narrowed in place; None where nothing is left out, and while an audit probes
    the runs (its probes observe the whole release of every step)."""
    if not any(quick) or any(r.probes for r in runs):
        return None
    # an audit's runs share their federation's test set (Federation.with_clients): read once
    feds = {(id(r.federation.private), id(r.federation.test)): r.federation for r in runs}
    tests = [torch.as_tensor(f.test_arrays()[0], device=device) for f in feds.values()]
    unused = UnusedInputs.find(net, list(params), [records.in_use()], tests)
    if unused is not None:
        unused.narrow(params)
        records.x = unused.records(records.x)
    return unused


class _Records:
    """The records the runs train on, each once (an audit's runs draw theirs from one
    federation's: :meth:`~privkit.data.federation.Federation.with_clients`) with a zero record
    after them (the pads'), and a step's batches of all runs gathered from them in one pass. The
    runs not sampled together draw their batches from their own streams, as opacus' loader
    draws them; the seeded reference runs' are drawn together (:class:`~privkit.batched.many.
    JointSampling`: each run's law, not its stream's numbers). A quick DP-SGD audit's seventeen
    runs held seventeen copies of their pooled records (170 MB) and gathered their batches one
    run at a time (three gathers a run a step)."""

    def __init__(self, runs: list[_Run], quick: list[bool], device: torch.device):
        self.runs = runs
        # per distinct record set (by identity), the members of the runs on it
        sets: dict[int, tuple] = {}
        for r in runs:
            private = r.federation.private
            sets.setdefault(id(private), (private, []))[1].append(r.members)
        start: dict[int, tuple[int, np.ndarray]] = {}  # each set's first row, its rows held
        total = 0
        for key, (_, members) in sets.items():
            held = np.unique(np.concatenate(members))  # sorted, each once
            start[key], total = (total, held), total + len(held)
        first_set = next(iter(sets.values()))[0]
        # gathered straight into one tensor (no second copy of a large record set), a zero
        # record after them: the pads' row
        x = torch.empty((total + 1, *first_set.x.shape[1:]), dtype=torch.float32)
        y = torch.empty(total + 1, dtype=torch.long)
        for key, (private, _) in sets.items():
            lo, held = start[key]
            picked = torch.as_tensor(held)
            xs = torch.as_tensor(private.x, dtype=torch.float32)  # a view where float32
            torch.index_select(xs, 0, picked, out=x[lo : lo + len(held)])
            y[lo : lo + len(held)] = torch.as_tensor(private.y)[picked]
        x[total], y[total] = 0.0, 0
        self.x, self.y = x.to(device), y.to(device)
        pad = total
        # a run's batch (indices into its pooled records, Federation.members' order) maps to
        # rows of x through the runs' records joined: run j's are lookup[offsets[j]:offsets[j +
        # 1]], the pads' lookup[-1]
        index = []
        for r in runs:
            first, held = start[id(r.federation.private)]
            index.append(torch.as_tensor(np.searchsorted(held, r.members) + first))
        self.lookup = torch.cat([*index, torch.tensor([pad])])
        self.offsets = torch.tensor([0] + [r.n for r in runs]).cumsum(0)
        self.pad = int(self.offsets[-1])
        rows = [j for j, q in enumerate(quick) if q and runs[j].batches.seeded_torch]
        self.joint = JointSampling.over(
            rows,
            [runs[j].n for j in rows],
            [runs[j].rate for j in rows],
            runs[rows[0]].batches if rows else None,
            self.offsets,
        )
        together = self.joint.positions if self.joint is not None else []
        self.alone = [j for j in range(len(runs)) if j not in together]
        self.steps = torch.tensor([runs[j].steps for j in together])
        self.norms: torch.Tensor | None = None

    def in_use(self) -> torch.Tensor:
        """The records some run trains on, each once."""
        return self.x[:-1]

    def with_norms(self) -> None:
        """Keep each record's squared norm, the first layer's per-example input norm whenever it
        is drawn (as each step computed it from its batch: the same sums, bit for bit)."""
        self.norms = self.x.flatten(1).pow(2).sum(-1)

    def batches(
        self, t: int, live: list[int], scratch: dict
    ) -> tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Step ``t``'s batch sizes and padded batches ``(runs, width, ...)`` of records, labels
        and squared norms (None without norms), for the runs ``live`` (the others' empty), in
        buffers kept in ``scratch`` (read within the step)."""
        running = set(live)
        own = {j: self.runs[j].batch(t) for j in self.alone if j in running}
        counts, glob = batch_positions(
            own, self.joint, self.offsets, len(self.runs), pad=self.pad, alive=self.steps > t
        )
        m, width = glob.shape
        # queued: a plain copy to a GPU would wait for every kernel queued before it
        at = to_device(self.lookup[glob.view(-1)], self.x.device)
        xb = kept(scratch, "xb", (m, width, *self.x.shape[1:]), self.x)
        yb = kept(scratch, "yb", (m, width), self.y)
        torch.index_select(self.x, 0, at, out=xb.view(m * width, *self.x.shape[1:]))
        torch.index_select(self.y, 0, at, out=yb.view(-1))
        if self.norms is None:
            return counts, xb, yb, None
        nb = kept(scratch, "norms", (m, width), self.norms)
        torch.index_select(self.norms, 0, at, out=nb.view(-1))
        return counts, xb, yb, nb


def batchable(config) -> bool:
    """Whether the batched form covers ``config`` (SGD; an audit's probes and mutation are
    taken, see the module docstring)."""
    return config.optimizer == "sgd"


def train_dpsgd_runs(
    method: str, federations: list, configs: list, seeds: list[int], fast: list[bool] | None = None
) -> list:
    """``train("dpsgd", federations[j], configs[j], seeds[j])`` for every j, batched (see the
    module docstring; configurations it does not cover train one after the other). The configs
    are equal but for ``reproducible_noise`` (each run's streams); the runs ``fast`` marks (seeded
    reference runs) draw a step's noise together (:func:`~privkit.batched.many.joint_release`).

    Parameters
    ----------
    method : str
        The method, ``"dpsgd"``; passed on to ``train`` for runs trained one after the other.
    federations : list
        One federation per run; each run trains on its pooled records.
    configs : list
        One dpsgd trainer config per run, equal but for ``reproducible_noise`` (seeded streams, or
        release mode's secret ones); the first decides whether the batched form covers them
        (:func:`batchable`).
    seeds : list[int]
        One seed per run: its initialisation, and its ``poisson`` and ``noise`` streams in
        reproducible-noise mode (release mode's streams ignore it).
    fast : list[bool] or None
        One flag per run: ``True`` marks a seeded reference run, whose noise is drawn with the
        other such runs' of the same noise scale in one draw; ``None`` (default): none.
    """
    from privkit.methods.contract import train

    config = configs[0]
    if not batchable(config):
        return [train(method, f, c, seed=s) for f, c, s in zip(federations, configs, seeds)]
    device = resolve_device(config)
    given = [_Run(f, c, s, device) for f, c, s in zip(federations, configs, seeds)]
    if len({str(r.spec) for r in given}) != 1:
        raise ValueError("batched runs need one model architecture; found several")
    m = len(given)
    lead = given[0]  # the progress counts the first run's epochs, as train_one's bar does
    marks = [bool(f) for f in fast] if fast is not None else [False] * m
    # the seeded reference runs, whose noise is drawn together with their scale's others
    together = [f and r.noise.seeded_torch for f, r in zip(marks, given)]
    # The runs stacked with each group of reference runs that draw their noise together (one per
    # noise scale) side by side, the others first, each in the caller's order: a group's rows of
    # the stacked sums are then a range, which its joint release reads as a view, where
    # scattered rows were gathered every step (reference runs of other sizes calibrate other
    # scales). Each model's computation does not depend on its place in the stack.
    order = sorted(range(m), key=lambda j: (together[j], given[j].sigma if together[j] else 0.0, j))
    runs, fast = [given[j] for j in order], [marks[j] for j in order]
    quick = [together[j] for j in order]
    params, buffers = stacked_on([r.model for r in runs], device)
    names = list(params)  # the optimiser's parameter order, opacus' noise order
    net = StackedModels(runs[0].model, m)
    net.norm_offset = OPACUS_NORM_OFFSET
    records = _Records(runs, quick, device)
    unused = _narrowed(runs, quick, net, params, records, device)
    if net.linear_on_input:
        records.with_norms()
    std = [r.sigma * config.clip_norm for r in runs]
    # an audit's mutation: clipping off for records and canaries (the noise stays calibrated to
    # the claimed clip norm, as opacus' hooks run it); its noise factor acts in the primitive
    clip = config.clip_norm if mutations.active().clipping else math.inf
    expected = torch.tensor([float(r.expected) for r in runs], device=device)
    # an audit's reference runs skip what only a report reads: the test accuracies of all but
    # their last epoch (as the federated reference runs skip their rounds')
    unreported(runs, fast)
    # each run's summed loss since its last epoch row, in float64 as the single run sums it
    loss_sums = torch.zeros(m, dtype=torch.float64, device=device)
    # a step's batch and the reference runs' joint noise in buffers kept across the steps: a
    # fresh tensor of megabytes is fresh pages on every step (privkit.batched.buffers)
    scratch: dict = {}
    for t in range(max(r.steps for r in runs)):
        live = [j for j, r in enumerate(runs) if t < r.steps]
        counts, xb, yb, nb = records.batches(t, live, scratch)
        losses = torch.zeros(m, device=device)
        sizes = to_device(torch.tensor(counts), device)  # queued: a plain copy would wait

        # called within this step only; the defaults bind this step's batch all the same
        def example_losses(
            out: torch.Tensor, models: torch.Tensor, s: slice, yb=yb, sizes=sizes, losses=losses
        ) -> torch.Tensor:
            ce = cross_entropy(out, yb[models, s])
            keep = (
                torch.arange(s.start, s.start + ce.shape[1], device=device)[None, :]
                < sizes[models, None]
            )
            losses.index_add_(0, models, torch.where(keep, ce, 0.0).detach().sum(1))
            return ce

        sums, _ = net.clipped_sums(
            params, buffers, xb, example_losses, clip, counts=counts, input_norms=nb
        )
        with torch.no_grad():
            # an audit's canaries of each probed run, sampled from its noise stream before its
            # noise and added to its clipped sum (the single run's ProbedStep)
            probed = {
                j: ProbedStep(
                    runs[j].probes, runs[j].noise, runs[j].rate, clip, [sums[k][j] for k in names]
                )
                for j in live
                if runs[j].probes
            }
            observed: dict[int, list[torch.Tensor]] = {}
            groups: dict[float, list[int]] = {}
            for j in live:
                if quick[j]:  # reference runs: their noise in one draw per noise scale
                    groups.setdefault(std[j], []).append(j)
                    continue
                own = {k: sums[k][j] for k in names}
                whole = own if unused is None else unused.whole(own)
                noisy = runs[j].noisy(whole, std[j], config.clip_norm)
                if j in probed:
                    observed[j] = [noisy[k] for k in names]
                if unused is not None:  # its release over every input, stepped in two parts
                    unused.step(params, j, noisy, expected[j], config.lr)
                    continue
                for k in names:
                    params[k][j].add_(noisy[k] / expected[j], alpha=-config.lr)
            for s, rows in groups.items():
                noisy, receipts = joint_release(
                    sums,
                    rows,
                    std=s,
                    clip=config.clip_norm,
                    source=runs[rows[0]].noise,
                    sample_rates=[runs[j].rate for j in rows],
                    # one buffer per noise scale: a group's noisy rows are read until the step ends
                    scratch=scratch.setdefault(("release", s), {}),
                )
                for row, j in enumerate(rows):
                    runs[j].receipts.append(receipts[row])
                    if j in probed:
                        observed[j] = [noisy[k][row] for k in names]
                at = rows_of(rows, device)  # a slice where the rows are a range: in place
                for k in names:
                    scale = expected[at].view(-1, *([1] * (noisy[k].dim() - 1)))
                    # one pass over the rows (p[at] -= lr * (n / s) took four: 1.2 ms a step
                    # for 16 runs' 784 x 64 weights against 0.3 ms)
                    if isinstance(at, slice):
                        params[k][at].addcdiv_(noisy[k], scale, value=-config.lr)
                    else:
                        params[k][at] = params[k][at].addcdiv(noisy[k], scale, value=-config.lr)
                ending = [j for j in rows if runs[j].steps == t + 1]
                if unused is not None and ending:  # the unused inputs' noise of all their steps
                    unused.lumped_noise(
                        ending,
                        t + 1,
                        std=s,
                        source=runs[rows[0]].noise,
                        expected=expected[ending],
                        lr=config.lr,
                    )
            for j, step in probed.items():
                step.observe(observed[j])
        loss_sums += losses.double()  # run by run, the float64 additions of a Python float's
        for j in live:
            r = runs[j]
            r.seen += counts[j]
            if (t + 1) % r.per_epoch == 0:  # the end of an epoch: opacus' per-epoch row
                r.rounds.append(
                    {
                        "round": (t + 1) // r.per_epoch,
                        "steps": t + 1,
                        "loss": float(loss_sums[j]) / max(r.seen, 1),
                        "test_accuracy": (
                            _test_accuracy(
                                r,
                                {k: params[k][j] for k in names}
                                if unused is None
                                else unused.weights(params, j),
                                device,
                            )
                            if r.report_metrics or t + 1 + r.per_epoch > r.steps  # the last epoch's
                            else math.nan
                        ),
                    }
                )
                loss_sums[j], r.seen = 0.0, 0
        if (t + 1) % lead.per_epoch == 0:  # train_one's bar counts the (first) run's epochs
            round_done()
    if unused is not None:
        unused.restore(params)
    out = []
    for r, released in zip(
        runs,
        load_states(
            runs[0].spec,
            [{k: v[j].detach().cpu().clone() for k, v in params.items()} for j in range(m)],
        ),
    ):
        history: list[dict] = [
            {
                "round": row["round"],
                "test_accuracy": row["test_accuracy"],
                "loss": row["loss"],
                "steps": row["steps"],
            }
            for row in r.rounds
        ]
        out.append(
            dpsgd_result(
                r.federation,
                r.config,
                r.seed,
                released,
                r.spec,
                history,
                r.plan,
                device,
                receipts=r.receipts,
            )
        )
    back = {j: at for at, j in enumerate(order)}
    return [out[back[j]] for j in range(m)]


__all__ = ["batchable", "train_dpsgd_runs"]
