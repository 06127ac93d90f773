"""Many convolutional models' local training and logits at once: an audit's reference clients.

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
not bits, the attacks use, as the MLPs' stacked kernels; docs/auditing-methods.md). A step of eight
default-size CNNs (batch 32, Adam) takes 0.65-0.68 of eight single models' steps on one CPU
thread: grouped convolutions run at about a single model's rate there, so the saving is the
per-model overhead and the dense layers' batched products (docs/performance.md).
:func:`stacked_logits_on` gives many such models' logits on shared records in one pass (FedDF's
and FedAUX's teachers).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from attacks.transfers import to_device
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


#: models trained together through all their steps on the CPU (one group after the other): a
#: step of 16 default-size CNNs (batch 32, Adam) ran at 0.73 of sixteen single models' steps, 8 at
#: 0.65-0.68, 4 at 0.90, 32 at 0.78 and 64 at 1.14; for quickstart-size CNNs 8 and 16 at 0.56-0.78
#: (docs/performance.md). Many models at once take their batch in chunks of a few examples
#: (StackedModels.chunk_size), each reading every model's dense weights again.
MODELS_PER_GROUP = 8


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
    stacked kernels, :data:`MODELS_PER_GROUP` models at a time on the CPU (all of them on a GPU);
    ``template``: the models' architecture (:func:`stacked_form`). ``scratch``: the step's
    gathered batch, kept by a caller that trains every round."""
    n = len(models)
    if n == 0:
        return []
    scratch = {} if scratch is None else scratch
    if len({m.soft for m in models}) > 1:
        raise ValueError("stacked models must all have label or all soft targets")
    group = MODELS_PER_GROUP if models[0].x.device.type == "cpu" else n
    net = stacked_form(template, min(n, group))
    # longest first: within a group the models still training at step t are a prefix
    order = sorted(range(n), key=lambda j: -models[j].steps)
    out = [0.0] * n
    for lo in range(0, n, group):
        rows = order[lo : lo + group]
        totals = _train_group(
            net,
            [models[j] for j in rows],
            optimizer=optimizer,
            lr=lr,
            mu=[0.0 if mu is None else float(mu[j]) for j in rows],
            anchors=None if anchors is None else [anchors[j] for j in rows],
            loss_from=[float("inf") if loss_from is None else loss_from[j] for j in rows],
            scratch=scratch,
        )
        for j, total in zip(rows, totals):
            out[j] = total
    return out


def _train_group(
    net: StackedModels,
    ms: list[Model],
    *,
    optimizer: str,
    lr: float,
    mu: list[float],
    anchors: list[dict[str, torch.Tensor]] | None,
    loss_from: list[float],
    scratch: dict,
) -> list[float]:
    """:func:`train_stacked` for one group ``ms``, longest first."""
    names = list(ms[0].initial())
    params = {k: torch.stack([m.initial()[k].detach() for m in ms]) for k in names}
    m1 = {k: torch.zeros_like(v) for k, v in params.items()}
    m2 = {k: torch.zeros_like(v) for k, v in params.items()}
    pull = torch.tensor(mu, device=params[names[0]].device)
    anchor = (
        {k: torch.stack([a[k].detach() for a in anchors]) for k in names}
        if anchors is not None and any(mu)
        else {}
    )
    totals = [0.0] * len(ms)
    steps = [m.steps for m in ms]
    x0, y0 = ms[0].x, ms[0].y
    for t in range(steps[0]):
        a = sum(1 for s in steps if s > t)
        batches = [ms[i].batches[t] for i in range(a)]
        counts = [len(b) for b in batches]
        width = max(counts)
        xb = kept(scratch, "x", (a, width, *x0.shape[1:]), x0)
        yb = kept(scratch, "y", (a, width, *y0.shape[1:]), y0)
        for i, b in enumerate(batches):  # gathered into the buffers, the pads zeroed
            torch.index_select(ms[i].x, 0, b, out=xb[i, : len(b)])
            torch.index_select(ms[i].y, 0, b, out=yb[i, : len(b)])
            if len(b) < width:
                xb[i, len(b) :].zero_()
                yb[i, len(b) :].zero_()
        live = {k: v[:a] for k, v in params.items()}
        size = to_device(torch.tensor(counts), xb.device)  # queued: a plain copy would wait
        grads, mean = step_gradients(net, live, {}, xb, yb, size)
        with torch.no_grad():
            loss = mean.double()
            if anchor:  # mu (theta - anchor): the proximal term's gradient, its value counted
                extra = torch.zeros(a, dtype=torch.float64, device=xb.device)
                for k in names:
                    d = live[k] - anchor[k][:a]
                    factor = pull[:a].view(-1, *([1] * (d.dim() - 1)))
                    grads[k] = grads[k] + factor * d
                    extra += 0.5 * pull[:a].double() * d.double().pow(2).flatten(1).sum(1)
                loss = loss + extra
            counted = [i for i in range(a) if t >= loss_from[i]]
            if counted:
                got = loss.tolist()
                for i in counted:
                    totals[i] += got[i] * counts[i]
            update = [live[k] for k in names]
            if optimizer == "adam":
                step = torch.full((), float(t + 1), device=xb.device)
                moments = [m1[k][:a] for k in names], [m2[k][:a] for k in names]
                adam_step(update, [grads[k] for k in names], *moments, step, lr)
            else:
                torch._foreach_add_(update, [grads[k] for k in names], alpha=-lr)
    with torch.no_grad():  # the trained parameters into each model's own
        for i, m in enumerate(ms):
            for k in names:
                m.params[k].copy_(params[k][i])
    return totals


#: records per chunk of :func:`stacked_logits_on`'s forward pass on the CPU: 16 to 128 took
#: 0.43-0.49 s for eight default CNNs on 1,438 records (one model after the other: 1.22 s)
LOGITS_CHUNK = 32

#: model-records per chunk of :func:`stacked_logits_on`'s pass on a GPU, where every model is in
#: one group: an audit's FedMD reference parties of one architecture (a hundred default CNNs) on
#: a 1,000-record test set at once would hold about 8 GB of activations, 16,384 model-records
#: about 1.2 GB (75 KB a record of a default CNN)
GPU_MODEL_RECORDS = 16384


def records_per_chunk(models: int, records: int, device_type: str) -> int:
    """How many records :func:`stacked_logits_on` passes through ``models`` models at a time."""
    if device_type == "cpu":
        return LOGITS_CHUNK
    return max(1, min(records, GPU_MODEL_RECORDS // models))


def stacked_logits_on(models: Sequence[nn.Module], x, device: torch.device) -> np.ndarray:
    """Every model's logits on the records ``x`` (``(n, ...)``, shared by all), ``(models, n,
    classes)`` float32: one stacked forward pass (:class:`StackedModels`: grouped convolutions,
    channels last, pooling before the ReLU) per chunk of records, equal to each model's own
    forward pass up to float rounding; it reads the models' parameters and buffers only. An
    architecture :class:`StackedModels` does not cover, or models of different shapes, are an
    UnsupportedModelError. The server step of FedDF's and FedAUX's reference runs
    (:func:`~privkit.batched.many_fedavg.stacked_teachers`) for a CNN: the clients' own forward
    passes, one model after the other on the whole set, ran pooling and ReLU on the convolutions'
    full outputs in the contiguous layout (eight default CNNs on 1,438 records: 1.22 s, stacked
    0.43 s). On the CPU :data:`MODELS_PER_GROUP` models at a time (an audit's FedMD reference
    parties of one architecture, evaluated together, are a hundred)."""
    shapes = [[(k, tuple(q.shape)) for k, q in m.state_dict().items()] for m in models]
    if any(s != shapes[0] for s in shapes):
        raise UnsupportedModelError("stacked logits need models of one architecture")
    xt = torch.as_tensor(x).to(device=device, dtype=torch.float32)
    if len(xt) == 0:  # no logits to stack; the models' own passes give the empty ones
        raise UnsupportedModelError("stacked logits need at least one record")
    group = MODELS_PER_GROUP if xt.device.type == "cpu" else len(models)
    parts = [_logits_of(models[lo : lo + group], xt, device) for lo in range(0, len(models), group)]
    return np.concatenate(parts) if len(parts) > 1 else parts[0]


def _logits_of(models: Sequence[nn.Module], xt: torch.Tensor, device: torch.device) -> np.ndarray:
    """:func:`stacked_logits_on` for one group of models (``xt``: the records on the device)."""
    net = StackedModels(models[0], len(models))
    named = [dict(m.named_parameters()) for m in models]
    kept_buffers = [dict(m.named_buffers()) for m in models]
    with torch.no_grad():
        params = {k: torch.stack([p[k].detach() for p in named]).to(device) for k in named[0]}
        buffers = {k: torch.stack([b[k] for b in kept_buffers]).to(device) for k in kept_buffers[0]}
        step = records_per_chunk(len(models), len(xt), xt.device.type)
        out = []
        for lo in range(0, len(xt), step):
            part = xt[lo : lo + step]
            logits, _ = net.forward(
                params, buffers, part.unsqueeze(0).expand(len(models), *part.shape)
            )
            out.append(logits)
        return torch.cat(out, 1).cpu().numpy().astype(np.float32, copy=False)


__all__ = [
    "GPU_MODEL_RECORDS",
    "LOGITS_CHUNK",
    "MODELS_PER_GROUP",
    "records_per_chunk",
    "stacked_form",
    "stacked_logits_on",
    "train_stacked",
]
