"""Many runs of one method at once: batched federations (the reference runs of an audit).

An audit trains the target's fair-coin run and its reference runs: the same method, trainer config
and federation layout on other records, each with its own seed. Run one after the other, each is
a whole federation, and the audit costs 17 trainings. :func:`train_many` trains them as one
computation where the method allows: the clients of every run that train in a round step
together, each with its own Poisson sampling, per-example clipping, noise and optimiser exactly
as the single run does. What happens between rounds (client sampling, the budget check,
accounting, averaging, evaluation) is the single run's own code, run per run: each method's
trainer is written as a run object whose rounds are driven from outside (:class:`~privkit.
trainers.dp_fedavg.DpFedRun`, :class:`~privkit.trainers.fedkd.FedKdRun`, :class:`~privkit.trainers.
fedavg.FederatedRun`, :class:`~privkit.trainers.fedmd.FedMDRun`), so both paths share every line
except the local training. Two engines do the local training:

* the DP-SGD methods (:func:`local_dp_sgd`; dpsgd: :mod:`privkit.batched.many_dpsgd`) stack the
  models' parameters on one axis (clients x runs, :class:`~privkit.mechanisms.stacked.StackedModels`)
  and take one forward and backward pass per step for all of them; each model keeps the receipts
  of its releases (:attr:`LocalDp.receipts`), which its run's ledger records as the single run's
  does (``finish_round(states, receipts)``);
* the methods trained with Adam (FedAvg, FedProx, FedDF, FedAUX, FedMD) run, per model, exactly
  the single run's kernels (:mod:`privkit.batched.exact_mlp`): Adam amplifies float rounding, so
  only bit-for-bit equal arithmetic keeps a batched run on its single run.

Same seeds, same result: in reproducible-noise mode each model draws its batches and noise from
the streams the single run draws them from, in the same order, so the weights agree with
:func:`privkit.trainers.train`'s up to float rounding (tested per method: at most 1e-5, and bit for
bit for the Adam methods). In release mode every stream is a fresh secret one, as in the single run.

Audits reach the batched runs as they reach the single run: inside an audit's probing block
(:func:`privkit.mechanisms.probes.probing`) each probed client's model takes its canaries
(:attr:`LocalDp.canaries`: sampled from its noise stream before the noise, clipped like a record,
added before the release and observing it, as :meth:`DpSgdStep.noisy_gradient
<privkit.mechanisms.dp_sgd_step.DpSgdStep.noisy_gradient>` does), and an audit's mutation acts in
the release primitive and the clipping as in the single step. The other mechanisms (FedAUX's
scores, FedMD-LDP's shared knowledge) run the single run's own code per run.

Methods with a batched form: those whose registry entry names one
(:attr:`privkit.methods.registry.TrainerSpec.batched`). FLiP's and centralised training's batch
only an audit's reference runs (:mod:`~privkit.batched.many_flip`, :mod:`~privkit.batched.
many_central`: their batched kernels drift from the single run by more than rounding, which their
training amplifies); their other runs train alone, each its single run bit for bit. The others
(FedAUXfdp and the DP-head baselines: docs/performance.md says why) and configurations a batched
form does not cover train one after the other.
"""

from __future__ import annotations

import contextvars
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from attacks.transfers import to_device
from privkit.batched.buffers import kept
from privkit.errors import PrivkitError
from privkit.mechanisms import mutations
from privkit.mechanisms.dp_random import DpRandom

if TYPE_CHECKING:
    from privkit.mechanisms.dp_sgd_step import DpSgdStep
    from privkit.mechanisms.gaussian import Receipt


def has_batched(method: str) -> bool:
    """Whether ``method``'s runs can train as one batched computation (its registry entry names
    a batched form, :attr:`privkit.methods.registry.TrainerSpec.batched`)."""
    from privkit.methods import get_trainer

    return get_trainer(method).batched is not None


def train_many(
    method: str,
    federations: Sequence,
    config: dict | None,
    seeds: Sequence[int],
    *,
    references: Sequence[bool] | None = None,
) -> list:
    """Run ``method`` on each federation with its seed: ``train(method, federations[j], config,
    seeds[j])`` for every j, as one batched computation where the method has one (its registry entry's ``batched``),
    else one after the other. Returns the :class:`~privkit.trainers.TrainResult` list.

    ``references[j]`` (default: none) marks run j as an audit's reference run, the auditor's own
    model, never released: it trains with ``reproducible_noise=True`` (the same noise laws from
    seeded generators) and, unless ``config`` itself asks for reproducible noise (whose runs equal
    their single runs on every executor), batched for speed rather than for equality with its
    single run: the Adam methods' stacked kernels instead of the exact per-model ones
    (:mod:`privkit.batched.exact_mlp`), the DP-SGD methods' noise and Poisson batches of all
    reference clients (or runs) of a step in one draw each (:class:`LocalDp`,
    :class:`JointSampling`: each one's law, not its stream's numbers). The other runs (an audit's target) train as ``config``
    says, in the same batch. Inside an audit's probing block or mutation every run takes the
    audit's probes and bug as its single run would (the module docstring).

    Parameters
    ----------
    method : str
        A registered training method (:func:`privkit.trainers.get_trainer`); the methods of
        a batched form train batched, the others one run after the other.
    federations : Sequence
        One federation per run (non-empty), in the same layout, each on its own records.
    config : dict or None
        The trainer config shared by every run (:func:`privkit.trainers.make_config`; ``None``:
        the method's defaults). Its ``reproducible_noise`` governs the runs not marked in
        ``references``: seeded noise, or release-mode secret streams.
    seeds : Sequence[int]
        One seed per run, ``len(federations)`` of them: run j is ``train(..., seed=seeds[j])``.
    references : Sequence[bool] or None
        One flag per run: ``True`` marks an audit's reference run (seeded noise, batched for
        speed, see above); ``None`` (default): no reference runs.
    """
    from privkit.methods.contract import get_trainer, make_config, stamp_noise, train

    if len(federations) != len(seeds) or not federations:
        raise ValueError(
            f"federations and seeds must be non-empty and equally long; found "
            f"{len(federations)} and {len(seeds)}"
        )
    refs = [False] * len(seeds) if references is None else [bool(r) for r in references]
    if len(refs) != len(seeds):
        raise ValueError(
            f"references must have one entry per run; found {len(refs)} for {len(seeds)} runs"
        )
    spec = get_trainer(method)
    cfg = make_config(method, config)
    seeded = cfg.model_copy(update={"reproducible_noise": True})
    configs = [seeded if r else cfg for r in refs]
    # a reproducible config promises every run its single run's result (on every executor)
    fast = [r and not cfg.reproducible_noise for r in refs]
    if spec.batched is None:
        return [train(method, f, c, seed=s) for f, c, s in zip(federations, configs, seeds)]
    results = spec.batched_fn(method, list(federations), configs, [int(s) for s in seeds], fast)
    for res, fed, c in zip(results, federations, configs):  # what train() adds to every result
        if res.method != method:
            raise PrivkitError(
                f"batched trainer of {method} returned a result labelled {res.method!r}"
            )
        res.check_chance(fed)
        stamp_noise(res, c.reproducible_noise)
    return results


def trains_batched_alone(method: str, config) -> bool:
    """Whether a single run of ``method`` with ``config`` trains through the batched engine
    (:func:`train_one`): wherever the method has a batched form, on every device.

    The batched engine steps a round's clients together, with the kernels an audit's target run
    takes; the loop (:func:`privkit.trainers.train`) trains one client after the other through
    autograd and ``torch.optim``, whose per-call overhead is most of a small model's step. On an
    accelerator the loop leaves the device idle between small kernels (issue 32: ``privkit train
    dp-fedavg --quick`` took 42.3 s on an H200 against 27.9 s on two CPU threads). On the CPU
    the batched engine trained the quick configurations 1.2-4.9x faster than the loop, one
    thread, release mode (``benchmarks/single_run.py``: FedAvg 1.16 s against 1.78 s, DP-SGD
    0.63 s against 3.07 s), and no slower with a CNN. A method whose batched form batches an
    audit's reference runs only (:attr:`~privkit.methods.registry.TrainerSpec.
    batched_references_only`: FLiP, centralised training) keeps the loop, and its progress bar:
    its single run is the loop on both paths. ``config`` is not read: a configuration a batched
    form does not cover trains one run at a time inside it (:func:`train_many`). The result is
    the loop's bit for bit for the methods trained with Adam (:mod:`privkit.batched.exact_mlp`)
    and up to float rounding for the DP-SGD methods in reproducible-noise mode (at most 2.4e-7
    on the quick configurations; tested per method, :func:`train_many`); their ledgers, client
    models and rounds are the loop's."""
    from privkit.methods.contract import get_trainer

    spec = get_trainer(method)
    return spec.batched is not None and not spec.batched_references_only


_ROUND_DONE: contextvars.ContextVar[Callable[[], None] | None] = contextvars.ContextVar(
    "privkit_batched_round_done", default=None
)


def round_done() -> None:
    """Advance :func:`train_one`'s progress bar by one round (or epoch), where one is shown."""
    done = _ROUND_DONE.get()
    if done is not None:
        done()


def train_one(method: str, federation, config, seed: int, progress: bool = False):
    """``train(method, federation, config, seed)`` through the method's batched form, one run
    (:func:`trains_batched_alone` says where ``privkit train`` and ``privkit run`` take it);
    ``progress`` shows its rounds as the loop's bar does."""
    from privkit.methods.contract import make_config

    cfg = make_config(method, config)
    if not progress:
        return train_many(method, [federation], cfg, [seed])[0]
    from rich.progress import Progress

    with Progress() as bar:
        rounds = getattr(cfg, "rounds", None)  # DP-SGD's bar counts its epochs
        unit = "rounds" if rounds is not None else "epochs"
        total = rounds if rounds is not None else getattr(cfg, "epochs", None)
        task = bar.add_task(f"{method} {unit} (batched)", total=total)
        token = _ROUND_DONE.set(lambda: bar.advance(task))
        try:
            return train_many(method, [federation], cfg, [seed])[0]
        finally:
            _ROUND_DONE.reset(token)


# ---------------------------------------------------------------------------- stacked parameters
def stack_states(
    models: Sequence[torch.nn.Module],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The models' parameters and buffers stacked on a leading model axis (detached copies)."""
    # each model's tensors listed once: a lookup per (name, model) walks the module every time
    # (FedKD+DP's pairs have 18 parameters: 92k walks in an audit)
    per_model = [(dict(m.named_parameters()), dict(m.named_buffers())) for m in models]
    params = {
        k: torch.stack([ps[k].detach() for ps, _ in per_model])
        for k, _ in models[0].named_parameters()
    }
    buffers = {
        k: torch.stack([bs[k].detach() for _, bs in per_model])
        for k, _ in models[0].named_buffers()
    }
    return params, buffers


def stacked_on(models: Sequence[torch.nn.Module], device: torch.device) -> tuple[dict, dict]:
    """:func:`stack_states` on ``device``."""
    params, buffers = stack_states(models)
    return {k: v.to(device) for k, v in params.items()}, {
        k: v.to(device) for k, v in buffers.items()
    }


def unstack(stacked: dict[str, torch.Tensor], j: int) -> dict[str, torch.Tensor]:
    """Model ``j``'s tensors of a stacked dict."""
    return {k: v[j] for k, v in stacked.items()}


def unreported(runs: Sequence, references: Sequence[bool] | None) -> None:
    """Mark an audit's reference runs (``references``) as never reported: their run objects skip
    the metrics only a report reads (``report_metrics``: every round's test accuracy, the
    client models' accuracies; what their training reads stays, and so do their models)."""
    for run, ref in zip(runs, references or []):
        run.report_metrics = not ref


def lockstep(
    runs: Sequence,
    local_round: Callable[[list, list[list[int]]], list | None],
    finish_together: Callable[[list, list], None] | None = None,
) -> None:
    """Drive run objects round by round: each run that goes on picks its clients (``next_round``;
    ``None`` once it has ended), ``local_round(runs, clients)`` trains the clients of all of them
    at once (returning per run what its ``finish_round`` takes: one argument, or a tuple of its
    arguments, e.g. the states and the clients' release receipts; or ``None`` when it takes
    nothing), then each run finishes its round, or ``finish_together(runs, outputs)`` finishes
    all of them (one argument each)."""
    if len({str(r.spec) for r in runs}) != 1:
        raise ValueError("batched runs need one model architecture; found several")
    while True:
        picked = [r.next_round() for r in runs]
        going = [i for i, s in enumerate(picked) if s is not None]
        if not going:
            return
        out = local_round([runs[i] for i in going], [picked[i] for i in going])
        if finish_together is not None and out is not None:
            finish_together([runs[i] for i in going], out)
        else:
            for at, i in enumerate(going):
                args = () if out is None else out[at] if isinstance(out[at], tuple) else (out[at],)
                runs[i].finish_round(*args)
        round_done()


# ---------------------------------------------------------------------------- local DP-SGD
@dataclass
class LocalDp:
    """One model's local DP-SGD (:class:`~privkit.mechanisms.dp_sgd_step.DpSgdStep`) in a batched
    step: its records, its mechanism and its two random streams (batches, noise).

    Parameters
    ----------
    x : torch.Tensor
        The model's (client's) records, ``(n, ...)``, on the stacked parameters' device.
    y : torch.Tensor
        Their labels (or other per-example targets of the loss), ``(n,)``.
    step : DpSgdStep
        Its mechanism: clip norm, noise multiplier, sampling rate and ``dataset_size == n``; every
        job of a batched step has the same clip norm.
    sample_gen : DpRandom
        The stream its Poisson batches are drawn from (``step.sample``).
    noise_gen : DpRandom
        The stream its Gaussian noise is drawn from: seeded in reproducible-noise mode, a secret
        one in release mode.
    fast : bool
        An audit's reference model with a seeded ``noise_gen`` (default ``False``): its noise is
        drawn together with the other such models' (:func:`joint_release`), and so are its
        Poisson batches where its ``sample_gen`` is seeded too.
    canaries : attacks.whitebox.GradientCanaries or None
        The audit's canaries of this model's mechanism (:meth:`DpSgdStep.probes
        <privkit.mechanisms.dp_sgd_step.DpSgdStep.probes>` for its client; over its trainable
        parameters in ``named_parameters`` order); ``None`` (default) outside an audit.
    receipts : list of Receipt
        The receipts of this model's releases, one per step in the order they ran, appended by
        :func:`local_dp_sgd` (empty at first): what its run's ledger records, as the single
        step's ``receipts`` (:meth:`DpSgdStep.noisy_gradient
        <privkit.mechanisms.dp_sgd_step.DpSgdStep.noisy_gradient>`).
    """

    x: torch.Tensor
    y: torch.Tensor
    step: DpSgdStep
    sample_gen: DpRandom
    noise_gen: DpRandom
    #: an audit's reference model (seeded streams): its noise is drawn with the other reference
    #: models' of the step in one draw (the same law, not its single run's numbers)
    fast: bool = False
    #: the audit's probes of this model's mechanism (None outside an audit's probing block)
    canaries: Any = None
    #: the receipts of this model's releases, one per step (local_dp_sgd appends them)
    receipts: list[Receipt] = field(default_factory=list)


#: losses(out, models, s, y, aux) -> (len(models), b) per-example losses of the examples s
ExampleLosses = Callable[
    [torch.Tensor, torch.Tensor, slice, torch.Tensor, torch.Tensor | None], torch.Tensor
]


def local_dp_sgd(
    net,
    params: dict[str, torch.Tensor],
    buffers: dict[str, torch.Tensor],
    jobs: Sequence[LocalDp],
    steps: int,
    *,
    lr: float,
    optimizer: str,
    losses: ExampleLosses,
    aux: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> None:
    """``steps`` DP-SGD steps of every job at once, in place on the stacked ``params``.

    Model j runs exactly :meth:`DpSgdStep.apply <privkit.mechanisms.dp_sgd_step.DpSgdStep.apply>`
    with its job's mechanism: a Poisson batch from its sample stream (the fast jobs' batches of
    a step drawn together from the first one's, :class:`JointSampling`: the same law), each example's gradient
    clipped to the clip norm (by ``net.clipped_sums``: :class:`~privkit.mechanisms.stacked.
    StackedModels` or a model of the same interface), Gaussian noise from its noise stream (one
    draw per parameter, in name order), the sum divided by the expected batch size, and one step
    of a fresh SGD or Adam optimiser. ``aux(xb)`` gives per-example auxiliary inputs of the loss
    (a teacher's logits) for the padded batch ``xb`` ``(M, B, ...)``. An audit's mutation
    (:mod:`privkit.mechanisms.mutations`) acts as in the single step (clipping here, the noise
    factor in the release primitive), and a job's canaries (:attr:`LocalDp.canaries`) are taken
    as the single step takes them: sampled from its noise stream before its noise, added to its
    clipped sum before the release, observing the release. Each release's receipt (Poisson
    subsampled at the job's rate, as the single step's) goes to its job's
    :attr:`LocalDp.receipts`, for its run's ledger.

    Parameters
    ----------
    net : StackedModels
        The stacked forward and clipped backward passes (``net.clipped_sums``):
        :class:`~privkit.mechanisms.stacked.StackedModels` of ``len(jobs)`` models, or an object of
        the same interface.
    params : dict[str, torch.Tensor]
        The models' parameters stacked on a leading model axis, each ``(len(jobs), ...)``
        (:func:`stacked_on`); updated in place.
    buffers : dict[str, torch.Tensor]
        The models' buffers, stacked the same way; left unchanged.
    jobs : Sequence[LocalDp]
        Model j's records, mechanism and streams, in the order of the model axis; none: nothing
        is done.
    steps : int
        DP-SGD steps every model takes.
    lr : float
        The optimiser's step size.
    optimizer : str
        ``"sgd"`` or ``"adam"`` (torch's defaults), a fresh optimiser per call.
    losses : ExampleLosses
        ``losses(out, models, s, y, aux)``: the per-example losses ``(len(models), b)`` of the
        examples ``s`` of the models ``models`` (:func:`ce_losses`: cross-entropy).
    aux : Callable or None
        ``aux(xb)``: per-example auxiliary inputs of the loss, ``(M, B, ...)``, for the padded
        batch ``xb``; ``None`` (default): the loss takes none.
    """
    from privkit.batched.batched_sgd import SGDRecipe, _StackedOptimizer

    if not jobs:
        return
    mutation = mutations.active()
    first = jobs[0].step
    clip = first.clip_norm if mutation.clipping else math.inf
    if any(j.step.clip_norm != first.clip_norm for j in jobs):
        raise ValueError("every job of a batched step must have the same clip norm")
    device = next(iter(params.values())).device
    names = list(params)  # the models' parameter order: the canaries' coordinates
    m = len(jobs)
    expected = torch.tensor([j.step.expected_batch_size for j in jobs], device=device)
    offsets = torch.tensor([0] + [len(j.y) for j in jobs]).cumsum(0)
    x_all = torch.cat([j.x for j in jobs])
    y_all = torch.cat([j.y for j in jobs])
    opt = _StackedOptimizer(params, SGDRecipe(lr=lr, optimizer=optimizer))
    active = torch.ones(m, device=device)
    # the steps' gathered batches, one buffer grown to the largest (a fresh batch of tens of MB
    # every step is fresh pages every step); a step's batch is read within that step only
    gathered = x_all.new_empty((0, *x_all.shape[1:]))
    scratch: dict = {}  # the releases' buffers, kept across the steps likewise (_noisy)
    joint = JointSampling.of(jobs, offsets)
    # each record's squared norm, the first layer's per-example input norm whenever it is drawn
    # (the sums each step formed from its batch, bit for bit)
    norms = x_all.flatten(1).pow(2).sum(-1) if net.linear_on_input else None
    for _ in range(steps):
        counts, glob = _step_batches(jobs, joint, offsets)
        width = glob.shape[1]
        glob = to_device(glob, device)  # queued: a plain copy would wait for the device
        if len(gathered) < width * m:
            gathered = x_all.new_empty((width * m, *x_all.shape[1:]))
        # gathered example-major: a chunk of it is already the (B, M*C, H, W) layout of convolutions
        flat = torch.index_select(x_all, 0, glob.T.reshape(-1), out=gathered[: width * m])
        xb, yb = flat.view(width, m, *x_all.shape[1:]).transpose(0, 1), y_all[glob]
        extra = aux(xb) if aux is not None else None

        # called within this step only; the defaults bind this step's batch all the same
        def example_losses(
            out: torch.Tensor, models: torch.Tensor, s: slice, yb=yb, extra=extra
        ) -> torch.Tensor:
            return losses(
                out, models, s, yb[models, s], None if extra is None else extra[models, s]
            )

        sums, _ = net.clipped_sums(
            params,
            buffers,
            xb,
            example_losses,
            clip,
            counts=counts,
            input_norms=None if norms is None else norms[glob],
        )
        grads = _noisy(sums, jobs, names, expected, scratch)
        opt.step(params, grads, active)


@dataclass
class JointSampling:
    """The Poisson batches of a step's fast jobs (seeded reference models) drawn together: one
    ``(jobs, largest client)`` draw of uniforms from the first one's sample stream, each row
    compared with its job's rate and cut at its job's size (each record of job j included
    independently at j's rate: the law of its own stream's batch, not its numbers)."""

    positions: list[int]  #: the fast jobs' positions on the model axis
    rows: torch.Tensor  #: the same, as a tensor
    inside: torch.Tensor  #: (rows, largest client): True at each job's records
    rates: torch.Tensor  #: (rows, 1) their sampling rates
    source: DpRandom  #: the first fast job's sample stream
    offsets: torch.Tensor  #: (rows,) where each one's records start in the joined records

    @classmethod
    def of(cls, jobs: Sequence[LocalDp], offsets: torch.Tensor) -> JointSampling | None:
        """The joint sampling of ``jobs``' fast ones (None for fewer than two)."""
        rows = [i for i, j in enumerate(jobs) if j.fast and j.sample_gen.seeded_torch]
        return cls.over(
            rows,
            [jobs[i].step.dataset_size for i in rows],
            [jobs[i].step.sample_rate for i in rows],
            jobs[rows[0]].sample_gen if rows else None,
            offsets,
        )

    @classmethod
    def over(
        cls,
        rows: list[int],
        sizes: list[int],
        rates: list[float],
        source: DpRandom | None,
        offsets: torch.Tensor,
    ) -> JointSampling | None:
        """The joint sampling of the models at ``rows`` on the model axis, of ``sizes`` records
        each sampled at ``rates``, drawn from ``source`` (a seeded stream); ``offsets``: where
        every model's records start in the joined records. None for fewer than two rows."""
        if len(rows) < 2 or source is None:
            return None
        at = torch.tensor(rows)
        n = torch.tensor(sizes)
        return cls(
            rows,
            at,
            torch.arange(int(n.max())) < n[:, None],
            torch.tensor([[float(q)] for q in rates]),
            source,
            offsets[at],
        )

    def draw(
        self, alive: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One step's batches: per sampled record its job's row (among ``rows``), its rank in
        that job's batch and its position in the joined records; and each job's batch size.
        ``alive`` (a bool per row; default all): the rows still training, the others' batches
        empty (their uniforms are drawn all the same)."""
        mask = self.source.mask(*self.inside.shape, rate=self.rates) & self.inside
        if alive is not None:
            mask &= alive[:, None]
        row, col = mask.nonzero(as_tuple=True)  # row-major: each row's records in order
        sizes = mask.sum(1)
        rank = torch.arange(len(row)) - (sizes.cumsum(0) - sizes)[row]  # less its row's start
        return row, rank, col + self.offsets[row], sizes


def _step_batches(
    jobs: Sequence[LocalDp], joint: JointSampling | None, offsets: torch.Tensor
) -> tuple[list[int], torch.Tensor]:
    """Every job's Poisson batch of a step: their sizes and the ``(jobs, largest)`` positions of
    their records in the joined records (0 past each batch). The fast jobs' batches are drawn
    together (``joint``), the others each from its own stream as the single step draws it."""
    together = set(joint.positions) if joint is not None else set()
    own = {i: j.step.sample(j.sample_gen) for i, j in enumerate(jobs) if i not in together}
    return batch_positions(own, joint, offsets, len(jobs))


def batch_positions(
    own: dict[int, torch.Tensor],
    joint: JointSampling | None,
    offsets: torch.Tensor,
    models: int,
    *,
    pad: int = 0,
    alive: torch.Tensor | None = None,
) -> tuple[list[int], torch.Tensor]:
    """A step's batches as positions in the joined records: the ``(models, largest batch)``
    positions (``pad`` past each batch) and every model's batch size. Model i's batch is
    ``own[i]`` (indices into its own records, drawn from its own stream) or the joint draw's
    (``joint``, its rows ``alive``); a model in neither has an empty batch."""
    counts = [0] * models
    for i, b in own.items():
        counts[i] = len(b)
    drawn = joint.draw(alive) if joint is not None else None
    if drawn is not None:
        for i, c in zip(joint.positions, drawn[3].tolist()):
            counts[i] = c
    glob = torch.full((models, max(1, max(counts))), pad, dtype=torch.long)
    for i, b in own.items():
        glob[i, : len(b)] = b + offsets[i]
    if drawn is not None:
        row, rank, at, _ = drawn
        glob[joint.rows[row], rank] = at
    return counts, glob


def _noisy(
    sums: dict[str, torch.Tensor],
    jobs: Sequence[LocalDp],
    names: list[str],
    expected: torch.Tensor,
    scratch: dict,
) -> dict[str, torch.Tensor]:
    """Model i's noisy sum as the single step releases it (:func:`privkit.mechanisms.gaussian_release`
    from the model's own stream: seeded, its tensors in name order; in release mode on one grid;
    an audit's noise factor applied there), divided by its expected batch size. The fast jobs
    (reference models, seeded) with equal clip norm are released together, one row each at its
    own noise scale, from the first one's stream: one draw for all of them.

    A job's canaries are taken as :meth:`DpSgdStep.noisy_gradient
    <privkit.mechanisms.dp_sgd_step.DpSgdStep.noisy_gradient>` takes them: every probed job's
    canaries are sampled from its own noise stream (before any noise is drawn from it) and added
    in place to its row of ``sums`` (``names``: the parameters' order, the canaries' layout); after
    the releases the rows are restored bit for bit and each job's canaries observe its release
    against its clean sum. Each job's receipt of the release (its own row's, for the fast jobs)
    goes to :attr:`LocalDp.receipts`. ``scratch``: buffers kept across the steps of a call of
    :func:`local_dp_sgd` (the gradients returned, every row written each step, and the fast
    rows' noise), each step's read within that step."""
    from privkit.mechanisms.gaussian import gaussian_release

    restores = {
        i: j.step._with_canaries({k: sums[k][i] for k in names}, names, j.canaries, j.noise_gen)
        for i, j in enumerate(jobs)
        if j.canaries is not None
    }
    released: dict[int, list[torch.Tensor]] = {}
    grads = {k: kept(scratch, ("grad", k), tuple(v.shape), v) for k, v in sums.items()}
    groups: dict[float, list[int]] = {}
    for i, j in enumerate(jobs):
        std = j.step.noise_multiplier * j.step.clip_norm
        if j.fast and j.noise_gen.seeded_torch:
            groups.setdefault(float(j.step.clip_norm), []).append(i)
            continue
        noisy, receipt = gaussian_release(
            {k: v[i] for k, v in sums.items()},
            std=std,
            sensitivity=j.step.clip_norm,
            source=j.noise_gen,
            sample_rate=j.step.sample_rate,
        )
        j.receipts.append(receipt)
        if i in restores:
            released[i] = [noisy[k] for k in names]
        for k, v in noisy.items():
            grads[k][i] = v / expected[i]
    for clip, rows in groups.items():
        at = rows_of(rows, expected.device)
        stds = [jobs[i].step.noise_multiplier * jobs[i].step.clip_norm for i in rows]
        noisy, receipts = joint_release(
            sums,
            rows,
            std=stds[0] if len(set(stds)) == 1 else stds,
            clip=clip,
            source=jobs[rows[0]].noise_gen,
            sample_rates=[jobs[i].step.sample_rate for i in rows],
            scratch=scratch.setdefault(("rows", clip), {}),
        )
        for r, i in enumerate(rows):
            jobs[i].receipts.append(receipts[r])
            if i in restores:
                released[i] = [noisy[k][r] for k in names]
        for k, v in noisy.items():
            scale = expected[at].view(-1, *([1] * (v.dim() - 1)))
            if isinstance(at, slice):  # written in place: no copy of the step's noisy sums
                torch.div(v, scale, out=grads[k][at])
            else:
                grads[k][at] = v / scale
    for i, restore in restores.items():
        restore()  # the clipped sum again, bit for bit: what the canaries observe against
        jobs[i].canaries.observe(released[i], clean=[sums[k][i] for k in names])
    return grads


def rows_of(rows: Sequence[int], device: torch.device) -> slice | torch.Tensor:
    """The positions ``rows`` on a model axis as a slice where they are a range (indexing by
    it gives views, not copies), else as an index tensor."""
    lo = rows[0] if rows else 0
    if list(rows) == list(range(lo, lo + len(rows))):
        return slice(lo, lo + len(rows))
    return to_device(torch.tensor(list(rows)), device)  # queued: a plain copy would wait


def joint_release(
    sums: dict[str, torch.Tensor],
    rows: Sequence[int],
    *,
    std: float | Sequence[float],
    clip: float,
    source: DpRandom,
    sample_rates: Sequence[float | None],
    scratch: dict | None = None,
) -> tuple[dict[str, torch.Tensor], list[Receipt]]:
    """The noisy sums of the models ``rows`` of stacked ``sums`` (each ``(models, ...)``), one
    release each, all rows' noise in one ``(len(rows), width)`` draw from the seeded ``source``
    (:func:`privkit.mechanisms.gaussian_release_rows`: the numbers one release of the whole block
    takes, bit for bit, and a receipt per row at its own rate): an audit's reference models (the
    same law as each model's own stream, not its numbers). Returns each tensor's
    ``(len(rows), ...)`` noisy rows and each row's receipt (Poisson subsampled at its rate in
    ``sample_rates``), in the order of ``rows``.

    Parameters
    ----------
    sums : dict[str, torch.Tensor]
        Stacked sums of clipped gradients, each ``(models, ...)``; released in name order.
    rows : Sequence[int]
        The positions on the model axis of the models released.
    std : float or Sequence[float]
        The noise's standard deviation the mechanism claims (``noise_multiplier * clip``), the
        same for every row or one per row (FedKADP's runs adapt theirs); an audit's mutation
        scales what is drawn (in the primitive).
    clip : float
        The clip norm: each row's L2 sensitivity.
    source : DpRandom
        The seeded stream all rows' noise is drawn from (the first reference model's).
    sample_rates : Sequence[float or None]
        Each row's Poisson rate (its model's mechanism's), stated in its receipt.
    scratch : dict, optional
        Buffers kept by a caller that releases every step (:func:`local_dp_sgd`): several rows'
        noise is drawn into one kept there for their shape (the same numbers), and the noisy
        rows returned are views of it until the next release through the same ``scratch``.
    """
    from privkit.mechanisms.gaussian import gaussian_release_rows

    if len(sample_rates) != len(rows):
        raise ValueError(
            f"joint_release needs one sample rate per row; found {len(sample_rates)} for "
            f"{len(rows)} rows"
        )
    names = sorted(sums)
    pick = rows_of(rows, next(iter(sums.values())).device)
    blocks = [sums[k][pick].flatten(1) for k in names]  # views where the rows are a range
    widths = [b.shape[1] for b in blocks]
    # several rows: the blocks as they lie, drawn as their concatenation (scaled and added block
    # by block, no copy of the clean rows); one row: that concatenation itself (one vector)
    out = None
    if scratch is not None and len(rows) > 1 and len(blocks) > 1:
        out = kept(scratch, "noise", (len(rows), sum(widths)), blocks[0])
    parts, receipts = gaussian_release_rows(
        blocks if len(rows) > 1 else [torch.cat(blocks, 1)],
        std=std,
        sensitivity=clip,
        source=source,
        sample_rates=sample_rates,
        dim=sum(widths),
        out=out,
    )
    if len(rows) == 1:
        parts = parts[0].split(widths, 1)
    return {k: part.view(len(rows), *sums[k].shape[1:]) for k, part in zip(names, parts)}, receipts


def ce_losses(
    out: torch.Tensor, models: torch.Tensor, s: slice, y: torch.Tensor, aux
) -> torch.Tensor:
    """Per-example cross-entropy (:data:`ExampleLosses`).

    Parameters
    ----------
    out : torch.Tensor
        The logits, ``(len(models), b, classes)``.
    models : torch.Tensor
        The positions on the model axis of the models in ``out``.
    s : slice
        The examples' positions in the padded batch.
    y : torch.Tensor
        Their class labels, ``(len(models), b)``.
    aux : torch.Tensor or None
        Auxiliary inputs; ignored.
    """
    from privkit.batched.class_axis import cross_entropy

    return cross_entropy(out, y)


__all__ = [
    "JointSampling",
    "LocalDp",
    "batch_positions",
    "ce_losses",
    "has_batched",
    "joint_release",
    "local_dp_sgd",
    "lockstep",
    "rows_of",
    "stack_states",
    "stacked_on",
    "train_many",
    "unstack",
]
