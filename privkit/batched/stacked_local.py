"""Many convolutional models' local training at once: an audit's reference clients.

:func:`~privkit.batched.exact_mlp.train_exact` trains privkit MLPs together; a CNN's clients
trained one after the other, so a CNN federation's audit (FedAvg, FedProx, the local rounds of
FedDF and FedAUX) cost about one training per reference run. :func:`train_stacked` trains the
models of :class:`~privkit.batched.exact_mlp.Model` (each its records, its epochs' permutations cut
into batches, where it starts) on stacked parameters: a step is one forward and backward pass of
every model that still has a batch (:class:`~privkit.mechanisms.stacked.StackedModels`: grouped
convolutions, batched products; :func:`~privkit.batched.many_central.step_gradients`: each model's
gradient of its own batch's mean cross-entropy, padded rows weighing nothing), then one optimiser
pass over all of them (torch's fused Adam, or SGD), as
:func:`~privkit.trainers.common.train_supervised` trains each with a fresh optimiser, plus
FedProx's proximal term ``mu / 2 ||theta - anchor||^2``.

The result equals each model's own training up to float rounding, which Adam amplifies, so not bit
for bit: only an audit's reference runs train this way (the auditor's own models, whose statistics,
not bits, the attacks use, as the MLPs' stacked kernels; docs/auditing-methods.md). A step of 16
quickstart-size CNNs (batch 32, Adam) takes about 0.7 of sixteen single models' steps on one CPU
thread: grouped convolutions run at about a single model's rate there, so the saving is the
per-model overhead and the dense layers' batched products (docs/performance.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from privkit.batched.buffers import kept
from privkit.batched.exact_mlp import Model, adam_step
from privkit.batched.many_central import step_gradients
from privkit.mechanisms.stacked import StackedModels, UnsupportedModelError


def stacked_form(template: nn.Module, n: int) -> StackedModels:
    """``n`` models of ``template``'s architecture stacked; UnsupportedModelError where
    :class:`StackedModels` does not cover it, or where it has buffers (the models here carry
    their parameters only) or frozen parameters."""
    if any(True for _ in template.buffers()):
        raise UnsupportedModelError("stacked local training needs a model without buffers")
    if not all(p.requires_grad for p in template.parameters()):
        raise UnsupportedModelError("stacked local training needs every parameter trainable")
    return StackedModels(template, n)


def train_stacked(
    template: nn.Module,
    models: Sequence[Model],
    *,
    optimizer: str,
    lr: float,
    mu: Sequence[float] | None = None,
    anchors: Sequence[dict[str, torch.Tensor]] | None = None,
    loss_from: Sequence[int] | None = None,
    scratch: dict | None = None,
) -> list[float]:
    """Train every model over its batches (in place on its parameters) as
    :func:`~privkit.batched.exact_mlp.train_exact` does (the same arguments and returns: each
    model's summed ``(batch loss) x (batch size)`` from its step ``loss_from[j]`` on), with
    stacked kernels; ``template``: the models' architecture (:func:`stacked_form`). ``scratch``:
    the step's gathered batch, kept by a caller that trains every round."""
    n = len(models)
    if n == 0:
        return []
    scratch = {} if scratch is None else scratch
    if any(m.soft for m in models):
        raise UnsupportedModelError("stacked local training takes labels, not soft targets")
    net = stacked_form(template, n)
    # longest first: the models still training at step t are a prefix, whose rows are views
    order = sorted(range(n), key=lambda j: -models[j].steps)
    ms = [models[j] for j in order]
    names = list(ms[0].initial())
    params = {k: torch.stack([m.initial()[k].detach() for m in ms]) for k in names}
    m1 = {k: torch.zeros_like(v) for k, v in params.items()}
    m2 = {k: torch.zeros_like(v) for k, v in params.items()}
    mus = [0.0 if mu is None else float(mu[j]) for j in order]
    pull = torch.tensor(mus, device=params[names[0]].device)
    anchor = (
        {k: torch.stack([anchors[j][k].detach() for j in order]) for k in names}  # type: ignore[index]  # mu > 0: anchors
        if any(mus)
        else {}
    )
    first = [float("inf") if loss_from is None else loss_from[j] for j in order]
    totals = [0.0] * n
    steps = [m.steps for m in ms]
    x0, y0 = ms[0].x, ms[0].y
    for t in range(steps[0]):
        a = sum(1 for s in steps if s > t)
        batches = [ms[i].batches[t] for i in range(a)]
        counts = [len(b) for b in batches]
        width = max(counts)
        xb = kept(scratch, "x", (a, width, *x0.shape[1:]), x0)
        yb = kept(scratch, "y", (a, width), y0)
        for i, b in enumerate(batches):  # gathered into the buffers, the pads zeroed
            torch.index_select(ms[i].x, 0, b, out=xb[i, : len(b)])
            torch.index_select(ms[i].y, 0, b, out=yb[i, : len(b)])
            if len(b) < width:
                xb[i, len(b) :].zero_()
                yb[i, len(b) :].zero_()
        live = {k: v[:a] for k, v in params.items()}
        size = torch.tensor(counts, device=xb.device)
        grads, mean = step_gradients(net, live, {}, xb, yb, size)
        with torch.no_grad():
            loss = mean.double()
            if anchor:  # mu (theta - anchor): the proximal term's gradient, its value counted
                shape = (a,)
                extra = torch.zeros(shape, dtype=torch.float64, device=xb.device)
                for k in names:
                    d = live[k] - anchor[k][:a]
                    factor = pull[:a].view(-1, *([1] * (d.dim() - 1)))
                    grads[k] = grads[k] + factor * d
                    extra += 0.5 * pull[:a].double() * d.double().pow(2).flatten(1).sum(1)
                loss = loss + extra
            counted = [i for i in range(a) if t >= first[i]]
            if counted:
                got = loss.tolist()
                for i in counted:
                    totals[i] += got[i] * counts[i]
            update = [live[k] for k in names]
            if optimizer == "adam":  # fused Adam reads a gradient in its parameter's layout:
                # autograd's may be strided otherwise (a convolution's, channels last)
                grads = {k: g.contiguous() for k, g in grads.items()}
                step = torch.full((), float(t + 1), device=xb.device)
                moments = [m1[k][:a] for k in names], [m2[k][:a] for k in names]
                adam_step(update, [grads[k] for k in names], *moments, step, lr)
            else:
                torch._foreach_add_(update, [grads[k] for k in names], alpha=-lr)
    with torch.no_grad():  # the trained parameters into each model's own
        for i, m in enumerate(ms):
            for k in names:
                m.params[k].copy_(params[k][i])
    out = [0.0] * n
    for i, j in enumerate(order):
        out[j] = totals[i]
    return out


__all__ = ["stacked_form", "train_stacked"]
