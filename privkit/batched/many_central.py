"""Centralised (non-private) runs batched (:mod:`privkit.batched.many`): many models, one pass a step.

``train("centralized", ...)`` trains one model on the pooled client records
(:func:`privkit.trainers.centralized.train_centralized`): per epoch a permutation from the epoch's
seeded generator cut into batches (the last one partial), the mean cross-entropy of each batch,
one step of SGD whose optimiser lives across epochs, the test accuracy after each epoch. Its
batched form trains many such runs in lock-step on stacked models
(:class:`~privkit.mechanisms.stacked.StackedModels`: linear layers as one batched matrix product,
convolutions as one grouped convolution): each model takes its own batches from its own
generators, in the same order, its gradient that of its own batch's mean loss (padded rows weigh
nothing), and SGD's update ``p - lr g``; a run with fewer batches per epoch idles once its epoch's
batches have run out; after the last epoch every model's test accuracy comes from one stacked
forward pass (the batched runs are an audit's reference runs, whose per-epoch accuracies nothing
reads: their ``rounds`` hold the last epoch only). The weights equal the single run's up to float rounding, which SGD on a CNN amplifies
(quick configuration, 6 epochs: up to 4e-2, where a 1e-7 relative change of the initial weights
moves the single run by up to 2e-3; an MLP stays within 1e-5, tested). So only an audit's
reference runs (``fast``: the auditor's own models, whose statistics, not bits, the attacks use,
as the Adam methods' stacked kernels, :mod:`privkit.batched.many_fedavg`) train batched; every
other run trains alone and is its single run bit for bit. The result (ledger, warnings, claims)
is the single run's own code (:func:`~privkit.trainers.centralized.centralized_result`); its test
accuracy is the last epoch's, as the single run's is.

Adam is not batched: it amplifies float rounding (:mod:`privkit.batched.exact_mlp`), so those
runs train one after the other.
"""

from __future__ import annotations

import torch

from attacks.transfers import to_device
from privkit.batched.class_axis import cross_entropy
from privkit.batched.many import stacked_on
from privkit.mechanisms.stacked import LinearSums, StackedModels, UnsupportedModelError
from privkit.seeding import derive_seed, torch_generator
from privkit.trainers.centralized import centralized_result
from privkit.trainers.common import accuracy, minibatches, new_model, resolve_device

#: test examples per model in one stacked forward pass of the per-epoch evaluation
EVAL_CHUNK = 128


def batchable(config) -> bool:
    """Whether the batched form covers ``config`` (SGD: Adam's runs train one after the other)."""
    return config.optimizer == "sgd"


class _Run:
    """One run's pooled records, model, batches and per-epoch rows."""

    def __init__(self, federation, config, seed: int, device: torch.device):
        x, y = federation.pooled_arrays()
        self.federation, self.config, self.seed = federation, config, seed
        self.x = torch.as_tensor(x, dtype=torch.float32, device=device)
        self.y = torch.as_tensor(y, dtype=torch.long, device=device)
        self.model, self.spec = new_model(federation, config, derive_seed(seed, "init"))
        self.model.to(device)
        self.batch_seed = derive_seed(seed, "batches")
        self.rounds: list[dict] = []

    def epoch_batches(self, epoch: int) -> list[torch.Tensor]:
        """Epoch ``epoch``'s batches (record indices), drawn as the single run draws them."""
        gen = torch_generator(derive_seed(self.batch_seed, f"epoch{epoch}"))
        return list(minibatches(len(self.y), self.config.batch_size, gen))


def step_gradients(
    net: StackedModels,
    params: dict[str, torch.Tensor],
    buffers: dict[str, torch.Tensor],
    xb: torch.Tensor,
    yb: torch.Tensor,
    counts: torch.Tensor,
    chunk: int | None = None,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Per model the gradient of its batch's mean cross-entropy (its first ``counts[m]`` rows of
    the padded batch ``xb`` ``(M, B, ...)``; 0 where it has none) and that mean loss; with
    probability rows ``yb`` ``(M, B, classes)``, of its mean ``KL(yb || softmax)`` instead.

    The batch runs ``chunk`` examples per model at a time (default: :meth:`StackedModels.chunk_size`,
    about 8 MB of the largest convolutional activation on the CPU), each chunk's forward and
    backward pass in one, the gradients summed. The whole batch at once made 25 MB activations per
    step for 16 quickstart CNNs, fresh memory on every step (81-94 ms a step against 50-52 ms in
    chunks, docs/performance.md); the sum over chunks is the whole batch's up to float rounding.
    Over several chunks a linear layer's weight gradient waits for the whole batch
    (:class:`~privkit.mechanisms.stacked.LinearSums`: autograd gives each chunk's gradient of the
    layer's output, and one product over all the examples the sum)."""
    p = {k: v.detach().requires_grad_(True) for k, v in params.items()}
    width = xb.shape[1]
    step = max(1, chunk if chunk is not None else net.chunk_size(xb))
    weight = (torch.arange(width, device=xb.device)[None, :] < counts[:, None]).float()
    # each row's share of its model's mean: 1 / count, 0 on padding
    share = weight / counts.clamp(min=1)[:, None]
    linear = _linear_layers(net, p) if width > step else []
    sums = LinearSums(xb.shape[0], width) if linear else None
    own = [k for k in p if k.rsplit(".", 1)[0] not in linear]  # autograd's per chunk
    total: list[torch.Tensor] | None = None
    mean = torch.zeros(xb.shape[0], device=xb.device)
    for start in range(0, width, step):
        rows = slice(start, start + step)
        logits, recs = net.forward(p, buffers, xb[:, rows], record=linear)
        part = (_example_losses(logits, yb[:, rows]) * share[:, rows]).sum(1)
        grads = torch.autograd.grad(part.sum(), [p[k] for k in own] + [r.out for r in recs])
        if sums is not None:  # each linear layer's input and output gradient, for the batch's sum
            outs = grads[len(own) :]
            sums.put(
                {r.name: ("linear", r.inp.detach(), g) for r, g in zip(recs, outs)},
                None,
                None,
                rows,
            )
        grads = grads[: len(own)]
        total = list(grads) if total is None else [t.add_(g) for t, g in zip(total, grads)]
        mean += part.detach()
    assert total is not None  # width >= 1: a step has at least one live model's batch
    got = dict(zip(own, total)) | ({} if sums is None else sums.sums())
    return {k: got[k] for k in p}, mean


def _example_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each example's loss: cross-entropy at integer labels ``(M, b)``, or ``KL(targets ||
    softmax)`` at probability rows ``(M, b, classes)`` (``distill``'s, per example)."""
    if targets.is_floating_point():
        return (torch.xlogy(targets, targets) - targets * logits.log_softmax(-1)).sum(-1)
    return cross_entropy(logits, targets)


def _linear_layers(net: StackedModels, params: dict[str, torch.Tensor]) -> list[str]:
    """The linear layers of ``net`` whose weight and bias are both in ``params``."""
    return [
        name
        for name, layer in net.layers
        if isinstance(layer, torch.nn.Linear)
        and f"{name}.weight" in params
        and f"{name}.bias" in params
    ]


def _stacked_accuracy(
    net: StackedModels,
    params: dict[str, torch.Tensor],
    buffers: dict[str, torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    chunk: int,
) -> list[float]:
    """Per model m the fraction of ``x[m]`` (``(M, N, ...)``) its logits classify as ``y[m]``,
    ``chunk`` examples per model at a time."""
    right = torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
    with torch.no_grad():
        for start in range(0, x.shape[1], chunk):
            logits, _ = net.forward(params, buffers, x[:, start : start + chunk])
            right += (logits.argmax(-1) == y[:, start : start + chunk]).sum(1)
    return [float(r) / max(x.shape[1], 1) for r in right.tolist()]


def train_centralized_many(
    method: str, federations: list, configs: list, seeds: list[int], fast: list[bool] | None = None
) -> list:
    """``train("centralized", federations[j], configs[j], seeds[j])`` for every j: the runs
    ``fast`` marks (an audit's reference runs) batched (see the module docstring), the others one
    after the other (each is its single run bit for bit). Configurations the batched form does not
    cover (:func:`batchable`), or models :class:`~privkit.mechanisms.stacked.StackedModels` does not,
    train one after the other.

    Parameters
    ----------
    method : str
        The method, ``"centralized"``; passed on to ``train`` for runs trained one after the other.
    federations : list
        One federation per run; each run trains on its pooled records.
    configs : list
        One centralized trainer config per run, equal but for ``reproducible_noise`` (which this
        method, drawing no noise, does not read); the first decides whether the batched form
        covers them (:func:`batchable`).
    seeds : list[int]
        One seed per run: its initialisation and its epochs' batches.
    fast : list[bool] or None
        One flag per run: ``True`` marks a reference run, trained batched (its single run up to
        float rounding, which SGD on a CNN amplifies: the runs' statistics, not their bits,
        are what an audit uses); ``None`` (default): none, every run its single run.
    """
    from privkit.methods.contract import train

    m = len(seeds)
    flags = list(fast) if fast is not None else [False] * m
    batch = [j for j in range(m) if flags[j]] if batchable(configs[0]) else []
    out: list = [None] * m
    if batch:
        got = _train_batched(
            [federations[j] for j in batch], [configs[j] for j in batch], [seeds[j] for j in batch]
        )
        if got is not None:
            for j, res in zip(batch, got):
                out[j] = res
    for j in range(m):
        if out[j] is None:
            out[j] = train(method, federations[j], configs[j], seed=seeds[j])
    return out


def _train_batched(federations: list, configs: list, seeds: list[int]) -> list | None:
    """The runs batched (module docstring); ``None`` where the model is not stackable or a run
    has no records (the single run's epochs then report a NaN loss)."""
    config = configs[0]
    device = resolve_device(config)
    runs = [_Run(f, c, s, device) for f, c, s in zip(federations, configs, seeds)]
    if len({str(r.spec) for r in runs}) != 1:
        raise ValueError("batched runs need one model architecture; found several")
    if any(len(r.y) == 0 for r in runs):
        return None
    try:
        net = StackedModels(runs[0].model, len(runs))
    except UnsupportedModelError:
        return None
    m = len(runs)
    params, buffers = stacked_on([r.model for r in runs], device)
    names = list(params)
    tests = [r.federation.test_arrays() for r in runs]
    stacked_test = len({len(ty) for _, ty in tests}) == 1
    if stacked_test:  # every model's test set at once (the runs of an audit share one)
        x_test = torch.stack([torch.as_tensor(tx, dtype=torch.float32) for tx, _ in tests])
        y_test = torch.stack([torch.as_tensor(ty, dtype=torch.long) for _, ty in tests])
        x_test, y_test = x_test.to(device), y_test.to(device)
    for epoch in range(1, config.epochs + 1):
        batches = [r.epoch_batches(epoch) for r in runs]
        totals, seen = [0.0] * m, [0] * m
        for t in range(max(len(b) for b in batches)):
            live = [j for j in range(m) if t < len(batches[j])]
            counts = [len(batches[j][t]) if t < len(batches[j]) else 0 for j in range(m)]
            width = max(counts)
            xb = torch.zeros((m, width, *runs[0].x.shape[1:]), device=device)
            yb = torch.zeros((m, width), dtype=torch.long, device=device)
            for j in live:
                idx = to_device(batches[j][t], device)  # queued: a plain copy would wait
                xb[j, : len(idx)], yb[j, : len(idx)] = runs[j].x[idx], runs[j].y[idx]
            count = to_device(torch.tensor(counts), device)
            grads, losses = step_gradients(net, params, buffers, xb, yb, count)
            with torch.no_grad():  # a model without a batch this step has a zero gradient
                for k in names:
                    params[k].add_(grads[k], alpha=-config.lr)
            for j in live:
                totals[j] += float(losses[j]) * counts[j]
                seen[j] += counts[j]
        if epoch < config.epochs:
            # the reference runs' per-epoch test accuracies are read by nothing (an audit reports
            # each one's final accuracy): one evaluation, after the last epoch (16 runs' stacked
            # evaluation every epoch was 3.9 s of a 34 s audit)
            continue
        if stacked_test:
            accs = _stacked_accuracy(net, params, buffers, x_test, y_test, EVAL_CHUNK)
        for j, r in enumerate(runs):
            if not stacked_test:
                r.model.load_state_dict(
                    {k: params[k][j].detach().clone() for k in names}, strict=False
                )
            r.rounds.append(
                {
                    "round": epoch,
                    "test_accuracy": accs[j]
                    if stacked_test
                    else accuracy(r.model, *tests[j], device),  # type: ignore[call-arg]  # test_arrays is (x, y)
                    "loss": totals[j] / max(seen[j], 1),
                }
            )
    for j, r in enumerate(runs):
        r.model.load_state_dict({k: params[k][j].detach().clone() for k in names}, strict=False)
    return [
        centralized_result(
            r.federation,
            r.config,
            r.seed,
            r.model.cpu(),
            r.spec,
            r.rounds,
            device,
            # the last epoch's accuracy is the trained model's (the single run computes it twice)
            r.rounds[-1]["test_accuracy"] if stacked_test else None,
        )
        for r in runs
    ]


__all__ = ["batchable", "step_gradients", "train_centralized_many"]
