"""Many MLPs trained with (non-private) SGD or Adam at once, bit for bit as one at a time.

Adam divides each update by the root of its running mean of squared gradients plus ``eps``
(1e-8): a parameter whose gradient is at that scale (it sums terms of ~1e-2 that nearly cancel)
moves by up to the learning rate per step in reaction to a float rounding of 1e-9 in its gradient.
A batched path that sums the same products in another order (padded batches, another matrix
kernel) so drifts from the single run by 1e-3 within a few rounds: Adam amplifies rounding by
``lr / eps`` (measured on FedAvg's quick setting). This module therefore computes, for every
model of a step, exactly the operations autograd and ``torch.optim`` run for one model (the same
kernels on the same shapes: ``addmm`` forward, ``g.t().mm(a)`` weight gradients, the mean
cross-entropy's gradient, torch's single-tensor Adam or SGD update), so that each model's weights
equal the single run's bit for bit; what it saves is the Python, autograd and optimiser overhead,
which is most of a small model's step (the optimiser's update runs as ``torch._foreach_*`` over
all models' parameters, each tensor as the single-tensor optimiser updates it).

``train_exact(..., stacked=True)`` trains the same models with stacked kernels instead (one
batched matrix product per layer and one optimiser pass per parameter for the models of a step,
a cache-sized chunk of them at a time): equal to the single run up to float rounding, which Adam
then amplifies, so not bit for bit. An audit's reference runs take it (the auditor's own models,
never released: their statistics, not their bits, are what the attacks use;
docs/auditing-methods.md).

Covered: privkit's MLP (``Flatten``, ``Linear``/``ReLU`` hidden layers, linear head), trainable
or frozen features, an optional proximal term (FedProx). Anything else is an
:class:`~privkit.mechanisms.stacked.UnsupportedModelError` (callers train one at a time).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from privkit.batched.buffers import kept
from privkit.batched.class_axis import log_softmax
from privkit.errors import PrivkitError
from privkit.mechanisms.stacked import UnsupportedModelError
from privkit.models import FeatureClassifier

BETA1, BETA2, EPS = 0.9, 0.999, 1e-8  # torch.optim.Adam's defaults (privkit's make_optimizer)


def mlp_layers(model: nn.Module) -> list[str]:
    """Names of ``model``'s linear layers in order (``features.<i>`` ..., ``head``) when it is a
    privkit MLP (Flatten, then Linear + ReLU pairs, then the head); else UnsupportedModelError."""
    if not isinstance(model, FeatureClassifier) or not isinstance(model.features, nn.Sequential):
        raise UnsupportedModelError(
            f"exact batched training needs a privkit MLP; found {type(model).__name__}"
        )
    kids = list(model.features.named_children())
    if not kids or not isinstance(kids[0][1], nn.Flatten) or len(kids) % 2 != 1:
        raise UnsupportedModelError(
            "exact batched training needs Flatten, then Linear + ReLU pairs"
        )
    names = []
    for (n1, lin), (_, act) in zip(kids[1::2], kids[2::2]):
        if not isinstance(lin, nn.Linear) or not isinstance(act, nn.ReLU) or lin.bias is None:
            raise UnsupportedModelError(
                f"exact batched training needs Linear (with bias) + ReLU; found "
                f"{type(lin).__name__}, {type(act).__name__}"
            )
        names.append(f"features.{n1}")
    if model.head.bias is None:
        raise UnsupportedModelError("exact batched training needs a head with a bias")
    # read from the layers found (a walk of every parameter costs more than the rest of the check)
    layers = {f"features.{n}": lin for n, lin in kids[1::2]} | {"head": model.head}
    trainable = {
        f"{name}.{k}": getattr(layer, k).requires_grad
        for name, layer in layers.items()
        for k in ("weight", "bias")
    }
    if (
        len({trainable[f"{n}.weight"] == trainable[f"{n}.bias"] for n in names + ["head"]}) > 1
        or not trainable["head.weight"]
        # the backward pass stops at the first frozen layer from the top: none trains below it
        or any(
            trainable[f"{a}.weight"] > trainable[f"{b}.weight"]
            for a, b in itertools.pairwise(names)
        )
    ):
        raise UnsupportedModelError(
            "exact batched training needs whole layers trainable from some layer on"
        )
    return names + ["head"]


@dataclass
class Model:
    """One model of the batch: its parameters (trained in place), its records, their targets and
    each epoch's order of them (a permutation, cut into batches of ``batch_size``, the last one
    partial: :attr:`batches`, index tensors in step order). Targets are labels (mean cross-entropy,
    :func:`~privkit.trainers.common.train_supervised`) or, with ``soft``, probability rows
    (``KL(targets || softmax)`` per batch, :func:`~privkit.trainers.common.distill`). ``start``:
    the parameters training starts from where ``params`` does not hold them yet (a run's clients
    all start from its global model: the stacked form reads those once for all of them, where a
    copy into each client's module would be read again; ``params`` then receives the trained
    values of every parameter). ``inputs_used``: which inputs are nonzero in some record
    (:func:`_needed` fills it where None; a caller that trains the same records again, a
    client's from round to round, passes it back)."""

    params: dict[str, torch.Tensor]
    x: torch.Tensor
    y: torch.Tensor
    orders: list[torch.Tensor]
    batch_size: int
    soft: bool = False
    start: dict[str, torch.Tensor] | None = None
    inputs_used: torch.Tensor | None = None

    def initial(self) -> dict[str, torch.Tensor]:
        """The parameters training starts from."""
        return self.params if self.start is None else self.start

    @property
    def steps(self) -> int:
        """The number of batches (steps) over all epochs."""
        return len(self.orders) * -(-len(self.x) // self.batch_size)

    def sizes(self) -> list[int]:
        """Each batch's size, in step order."""
        n, b = len(self.x), self.batch_size
        return [min(b, n - start) for _ in self.orders for start in range(0, n, b)]

    @functools.cached_property
    def batches(self) -> list[torch.Tensor]:
        """The batches, in step order: each epoch's order cut as ``minibatches`` cuts it. The
        stacked form reads the orders whole (:func:`_train_stacked`): an audit's 1,700 FedAvg
        models would otherwise make 42,500 slices."""
        return [b for order in self.orders if len(order) for b in order.split(self.batch_size)]


def model_for(
    module: nn.Module,
    x,
    y,
    *,
    epochs: int,
    batch_size: int,
    seed: int,
    device: torch.device,
    soft: bool = False,
    start: dict[str, torch.Tensor] | None = None,
    inputs_used: torch.Tensor | None = None,
) -> Model:
    """``module`` (trained in place, from ``start`` where given: :class:`Model`) on ``(x, y)``
    with the batches ``train_supervised`` / ``distill`` draw for ``seed``: per epoch one
    permutation from ``torch_generator(seed)``, cut into batches of ``batch_size`` (the last one
    partial). ``inputs_used``: :attr:`Model.inputs_used`, where the caller has it."""
    from privkit.seeding import torch_generator
    from privkit.trainers.common import as_tensor

    # .to() and .train() walk every submodule and parameter even when there is nothing to change
    # (an audit's FedMD runs call this 3,800 times): they run only where a tensor is elsewhere
    # or a submodule is in eval mode, which one walk finds (_walk)
    named, buffers, training = _walk(module)
    if any(t.device != device for t in itertools.chain(named.values(), buffers)):
        module.to(device)
        named = _walk(module)[0]
    if not training:
        module.train()
    xt = as_tensor(x, device, torch.float32)
    yt = as_tensor(y, device, torch.float32 if soft else torch.long)
    if batch_size < 1:
        raise PrivkitError(f"batch_size must be >= 1; found {batch_size}")
    gen = torch_generator(seed)
    # minibatches' draws: one permutation per epoch from the generator, in turn
    orders = [torch.randperm(len(xt), generator=gen).to(device) for _ in range(epochs)]
    params = {k: q.detach() for k, q in named.items()}
    return Model(params, xt, yt, orders, batch_size, soft, start, inputs_used)


def _walk(module: nn.Module) -> tuple[dict[str, torch.Tensor], list[torch.Tensor], bool]:
    """``module``'s parameters as ``named_parameters()`` gives them (its order; a shared one once,
    under its first name), its buffers, and whether every submodule is in training mode, from
    one walk of its submodules: ``named_parameters()``, ``buffers()`` and ``modules()`` walk them
    three times through torch's generators (19 us of :func:`model_for`'s 39 us on a FedMD party
    MLP; this walk takes 10 us)."""
    params: dict[str, torch.Tensor] = {}
    buffers: list[torch.Tensor] = []
    seen: set = set()  # modules and parameters met, by identity, as torch de-duplicates them
    training = True
    # torch's pre-order (named_modules): a stack, not a recursive closure, whose reference to
    # itself would leave a cycle per call for the garbage collector (its collections then fell
    # within this function: 0.18 -> 0.35 s in some audits)
    stack = [("", module)]
    while stack:
        prefix, m = stack.pop()
        if m in seen:
            continue
        seen.add(m)
        training = training and m.training
        for k, q in m._parameters.items():
            if q is not None and q not in seen:
                seen.add(q)
                params[prefix + k] = q
        buffers.extend(b for b in m._buffers.values() if b is not None)
        kids = [(f"{prefix}{name}.", c) for name, c in m._modules.items() if c is not None]
        stack.extend(reversed(kids))
    return params, buffers, training


def architecture(module: nn.Module) -> tuple:
    """What models trained together by :func:`train_exact` must share."""
    return tuple((k, tuple(q.shape), q.requires_grad) for k, q in module.named_parameters())


@dataclass(frozen=True)
class Inputs:
    """Records as :func:`stacked_logits` reads them: flattened, float32 on a device, narrowed to
    the inputs nonzero in some record (``used``; None: all of them). A caller that reads the same
    records again keeps them: FedDF's teachers read one distillation set every round, and
    FedMD's three party architectures one public subset (a scan and a gather of the records
    each time: 0.4 ms for 1,438 digits alone, about 1 ms within an audit)."""

    records: torch.Tensor  # (n, len(used))
    used: torch.Tensor | None

    @classmethod
    def of(cls, x, device: torch.device) -> Inputs:
        """``x`` (any shape ``(n, ...)``) flattened and narrowed on ``device``."""
        h0 = torch.as_tensor(x).to(device=device, dtype=torch.float32).flatten(1)
        in_use = _inputs_in_use(h0)
        if bool(in_use.all()):
            return cls(h0, None)
        used = in_use.nonzero().flatten()
        return cls(h0.index_select(1, used), used)


@torch.no_grad()
def stacked_logits(
    modules: Sequence[nn.Module], x, device: torch.device, chunk: int = 64
) -> torch.Tensor:
    """The logits of privkit MLPs of one architecture (:func:`mlp_layers`, :func:`architecture`)
    for the same records ``x``, ``(len(modules), len(x), classes)`` float32 on the CPU: one
    batched product per layer for ``chunk`` models at a time, where ``predict_logits`` runs each
    module on its own (moving it to the device and setting its mode each call). Equal to each
    module's own forward up to float rounding (another product kernel), so an argmax can differ
    only where two logits tie to rounding: for an audit's reference runs' per-round accuracy
    (:mod:`privkit.batched.many_fedmd`), which no attack reads, and their teachers' logits
    (:func:`privkit.trainers.feddf.distillation_hook`). Inputs that are 0 in every record add
    nothing to the first layer's products and are left out of them (half of the public
    digits' 784 pixels). ``x``: the records, or their :class:`Inputs` on ``device``."""
    names = mlp_layers(modules[0])
    shape = architecture(modules[0])
    if any(architecture(m) != shape for m in modules):
        raise UnsupportedModelError("stacked logits need one architecture; found several")
    inputs = x if isinstance(x, Inputs) else Inputs.of(x, device)
    h0, used = inputs.records, inputs.used
    out = []
    for lo in range(0, len(modules), chunk):
        group = modules[lo : lo + chunk]
        for k, name in enumerate(names):
            layers = [m.get_submodule(name) for m in group]
            ws = [cast(nn.Linear, q).weight.detach() for q in layers]
            if k == 0 and used is not None:  # each model's columns gathered, then stacked: a
                # stack then a gather along its last axis took 2.5x as long (the same numbers)
                ws = [v.index_select(1, used.to(v.device)) for v in ws]
            w = torch.stack(ws).to(device)
            b = torch.stack([cast(nn.Linear, q).bias.detach() for q in layers]).to(device)
            if k == 0:  # every model reads the same records: one product against all their weights
                g, o = w.shape[:2]
                h = torch.addmm(b.reshape(1, g * o), h0, w.reshape(g * o, -1).t())
                h = h.view(-1, g, o).transpose(0, 1)
            elif k == len(names) - 1:  # the head's logits transposed, as _train_stacked takes them
                # (models, classes, records): its few classes would be the products' short side
                # (a FedDF run's ten teachers on 1,438 records: 0.33 ms where it took 0.97 ms)
                h = torch.baddbmm(b.unsqueeze(2), w, h.transpose(1, 2)).transpose(1, 2)
            else:
                h = torch.baddbmm(b.unsqueeze(1), h, w.transpose(1, 2))
            if k < len(names) - 1:
                h = h.relu_()
        out.append(h.cpu())
    return torch.cat(out)


def _gradients(
    layers: list[tuple[str, str, bool]],
    trainable: set[str],
    p: dict[str, torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    soft: bool,
    scale: torch.Tensor,
    rows: torch.Tensor,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The batch loss's gradients with autograd's kernels, and the log-probabilities (for the
    loss). ``scale`` is ``-1 / len(y)`` in float32: nll_loss's gradient at each label, and the
    factor of the targets in ``kl_div(..., reduction="batchmean")``'s; ``rows`` is ``arange(len(y))``."""
    aten = torch.ops.aten
    acts = [x.reshape(x.shape[0], -1)]
    for w, b, _ in layers[:-1]:
        acts.append(torch.relu(torch.addmm(p[b], acts[-1], p[w].t())))
    w, b, _ = layers[-1]
    logp = torch.log_softmax(torch.addmm(p[b], acts[-1], p[w].t()), 1)
    if soft:  # d/d log q of sum(t (log t - log q)) / B: (-(1 / B)) t
        g = y * scale
    else:
        g = torch.zeros_like(logp)
        g[rows, y] = scale
    g = aten._log_softmax_backward_data(g, logp, 1, logp.dtype)
    grads: dict[str, torch.Tensor] = {}
    for i in range(len(layers) - 1, -1, -1):
        w, b, below = layers[i]
        if w not in trainable:
            break
        grads[w] = g.t().mm(acts[i])
        grads[b] = g.sum(0)
        if below:
            g = aten.threshold_backward(g.mm(p[w]), acts[i], 0)
    return grads, logp


def train_exact(
    template: nn.Module,
    models: Sequence[Model],
    *,
    optimizer: str,
    lr: float,
    mu: Sequence[float] | None = None,
    anchors: Sequence[dict[str, torch.Tensor]] | None = None,
    loss_from: Sequence[int] | None = None,
    stacked: bool = False,
    scratch: dict | None = None,
) -> list[float]:
    """Train every model over its batches (in place on its parameters), as
    :func:`~privkit.trainers.common.train_supervised` trains one with a fresh ``optimizer``
    (``"sgd"`` or ``"adam"``) at ``lr``: mean cross-entropy per batch plus, where ``mu[j] > 0``,
    ``mu[j] / 2 ||theta - anchors[j]||^2`` over the trainable parameters. Returns each model's
    summed ``(batch loss) x (batch size)`` over its batches from ``loss_from[j]`` on (none without
    ``loss_from``): the batch's mean cross-entropy, or with soft targets its
    ``KL(targets || softmax)`` as :func:`~privkit.trainers.common.distill` takes it.

    The models take their steps in turns, each step's gradient and update together (one model's
    tensors stay in cache; an update of all models' parameters at once is bound by memory traffic).
    With ``stacked``, the models of a step in one computation instead, a cache-sized chunk of them
    through all their steps at a time (:func:`_train_stacked`: equal up to float rounding, not bit
    for bit); ``scratch``: its buffers, kept by a caller that
    trains every round (:mod:`privkit.batched.buffers`).
    """
    names = [k for k, q in template.named_parameters() if q.requires_grad]
    trainable = set(names)
    ls = mlp_layers(template)
    # per layer: weight and bias names, and whether the gradient goes on to a trainable layer below
    layers = [
        (f"{n}.weight", f"{n}.bias", i > 0 and f"{ls[i - 1]}.weight" in trainable)
        for i, n in enumerate(ls)
    ]
    if stacked:
        return _train_stacked(
            names,
            layers,
            models,
            optimizer,
            lr,
            mu=mu,
            anchors=anchors,
            loss_from=loss_from,
            scratch={} if scratch is None else scratch,
        )
    with torch.no_grad():  # the exact kernels train ``params`` in place, from where they start
        for m in models:
            if m.start is not None:
                for k, q in m.params.items():
                    q.copy_(m.start[k])
    n = len(models)
    mu = list(mu) if mu is not None else [0.0] * n
    first = list(loss_from) if loss_from is not None else [math.inf] * n
    moments = [
        (
            [torch.zeros_like(m.params[k]) for k in names],
            [torch.zeros_like(m.params[k]) for k in names],
        )
        for m in models
    ]
    totals = [0.0] * n
    consts: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}
    for t in range(max((len(m.batches) for m in models), default=0)):
        for j, m in enumerate(models):
            if t >= len(m.batches):
                continue
            b = m.batches[t]
            yb = m.y[b]
            key = (len(b), yb.device)
            if key not in consts:  # nll_loss's gradient -1 / total weight, in float32
                consts[key] = (
                    -(torch.ones((), device=yb.device) / len(b)),
                    torch.arange(len(b), device=yb.device),
                )
            g, logp = _gradients(layers, trainable, m.params, m.x[b], yb, m.soft, *consts[key])
            extra = None
            if mu[j] > 0:  # autograd's gradient of (mu/2) sum ||p - a||^2: (mu/2) (2 (p - a))
                half = 0.5 * mu[j]
                diffs = {k: m.params[k] - anchors[j][k] for k in names}  # type: ignore[index]  # mu > 0: anchors
                g = {k: g[k] + half * (2 * diffs[k]) for k in names}
                if t >= first[j]:
                    extra = sum((d.pow(2).sum() for d in diffs.values()), torch.zeros(())) * half
            if t >= first[j]:
                loss = (
                    torch.nn.functional.kl_div(logp, yb, reduction="batchmean")
                    if m.soft
                    else torch.nn.functional.nll_loss(logp, yb)
                )
                totals[j] += float(loss + extra if extra is not None else loss) * len(b)
            _update(
                optimizer,
                lr,
                t + 1,
                [m.params[k] for k in names],
                [g[k] for k in names],
                *moments[j],
            )
    return totals


def _records(
    ms: Sequence[Model], used: torch.Tensor | None = None, scratch: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every model's records and targets in one tensor each, and each model's first row in each;
    with ``used`` (:func:`_used_inputs`), model i's records at the inputs ``used[i]`` only.
    Models that hold the same records (the same tensor: FedMD's parties all train on the public
    data, an audit's FedDF runs distil on one copy) share one copy of them, and models that hold
    the same targets one copy of those: an audit's 160 such models would otherwise copy their
    records 160 times a round. The records are written in place into a buffer of ``scratch``
    (each model's gathered there directly: no copy per model, then none of the whole)."""
    x_at: dict[tuple, int] = {}
    y_at: dict[tuple, int] = {}
    flats, ys, x_starts, y_starts, total, y_total = [], [], [], [], 0, 0
    inputs = used.cpu().numpy() if used is not None else None
    for i, m in enumerate(ms):
        key = _layout(m.x)
        if inputs is not None:
            key += (inputs[i].tobytes(),)
        if key not in x_at:
            x_at[key] = total
            flats.append((i, m.x.reshape(len(m.x), -1), total))
            total += len(m.x)
        x_starts.append(x_at[key])
        y_key = _layout(m.y)
        if y_key not in y_at:
            y_at[y_key] = y_total
            ys.append(m.y)
            y_total += len(m.y)
        y_starts.append(y_at[y_key])
    width = used.shape[1] if used is not None else flats[0][1].shape[1]
    xs = kept({} if scratch is None else scratch, "records", (total, width), flats[0][1])
    for i, flat, start in flats:
        rows = xs[start : start + len(flat)]
        if used is None:
            rows.copy_(flat)
        else:
            torch.index_select(flat, 1, used[i], out=rows)
    return xs, torch.cat(ys), torch.tensor(x_starts), torch.tensor(y_starts)


def _layout(t: torch.Tensor) -> tuple:
    """What makes two tensors the same records for :func:`_records`: one memory, one view."""
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device)


def _inputs_in_use(records: torch.Tensor) -> torch.Tensor:
    """Which inputs (columns of ``records``, ``(n, inputs)``) are nonzero in some record: a sum
    of magnitudes is 0 only where every record is 0 (a NaN counts as used)."""
    return records.abs().sum(0) != 0


def _needed(ms: Sequence[Model]) -> torch.Tensor:
    """Per model, the inputs nonzero in any of its records, ``(models, inputs)``: its
    :attr:`Model.inputs_used`, computed where None (records that several models hold are read
    once) and kept there."""
    seen: dict[tuple, torch.Tensor] = {}
    for m in ms:
        if m.inputs_used is None:
            key = (m.x.data_ptr(), tuple(m.x.shape), m.x.stride())
            if key not in seen:
                seen[key] = _inputs_in_use(m.x.reshape(len(m.x), -1))
            m.inputs_used = seen[key]
    return torch.stack([cast(torch.Tensor, m.inputs_used) for m in ms])


def _used_inputs(need: torch.Tensor) -> tuple[torch.Tensor | None, list[int]]:
    """Per model, the inputs its first layer must see, ``(models, k)``: those ``need`` marks
    (``(models, inputs)``: :func:`_needed`, and for a model with a proximal term the inputs
    whose weights differ from the anchor's, :func:`_off_anchor`), then as many of its other
    inputs as pad every row to the longest; None where some model needs them all. Also each
    model's count of the inputs it must see (the first that many of its row)."""
    counts = need.sum(1).tolist()
    k = max(counts)
    if k == need.shape[1]:
        return None, counts
    # a stable sort puts the needed inputs first, then the unneeded ones, each in input order
    return torch.argsort((~need).to(torch.uint8), dim=1, stable=True)[:, :k], counts


def _off_anchor(
    starts: Sequence[torch.Tensor], anchors: Sequence[torch.Tensor | None]
) -> torch.Tensor:
    """Per model, the inputs at which its first layer's weights ``starts[i]`` (``(out, in)``)
    differ from its proximal anchor's ``anchors[i]`` (None: a model without a proximal term),
    ``(models, in)``: their proximal gradient is not 0, so they train whatever the records."""
    return torch.stack(
        [
            torch.zeros(s.shape[1], dtype=torch.bool, device=s.device)
            if a is None
            else (s != a).any(0)
            for s, a in zip(starts, anchors)
        ]
    )


@dataclass
class _FirstLayer:
    """Every model's first-layer weights (its start, or its proximal anchor), held transposed
    ``(in, out)`` and each distinct tensor once, and the one each model reads. A chunk's first
    layer is picked from these over its inputs (:func:`_pick_rows`) and put back into each
    model's parameters (:func:`_put_back`). A stack of every model's full weights was written,
    gathered from and scattered back into at every call, where an audit's reference clients of
    one run all start from its global model: 16 distinct tensors for 160 models, and 10-14 ms of
    a FedAvg round's data movement where the stack took 47-49 ms (docs/performance.md)."""

    weights: torch.Tensor  # (distinct, in, out)
    which: torch.Tensor  # (models,): each model's row of ``weights``

    @classmethod
    def of(
        cls, tensors: Sequence[torch.Tensor], scratch: dict | None = None, key=None
    ) -> _FirstLayer:
        """The distinct ``tensors`` stacked, into ``scratch[key]`` where a scratch is given: a
        FedMD audit's parties hold distinct weights, 23 MB a group, which as fresh memory at each
        of its 36 stacked trainings took 9 ms a stack against 5 ms into a kept buffer."""
        distinct, which = _distinct(tensors)
        weights = _stacked(distinct, True, scratch, key)
        return cls(weights, torch.tensor(which, device=weights.device))


def _pick_rows(
    first: _FirstLayer, rows: slice, used: torch.Tensor | None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The first-layer weights of the models ``rows`` at their inputs ``used`` (``(models, k)``;
    None: every input), ``(models, k, out)``, written into ``out`` where given: one row gather
    from the distinct weights."""
    w, models = first.weights, first.which[rows]
    if used is None:
        return torch.index_select(w, 0, models, out=out) if out is not None else w[models]
    d, inputs, width = w.shape
    index = (models[:, None] * inputs + used).reshape(-1)
    flat = w.view(d * inputs, width)
    got = (
        torch.index_select(flat, 0, index)
        if out is None
        else torch.index_select(flat, 0, index, out=out.view(-1, width))
    )
    return got.view(len(models), used.shape[1], width)


def _put_back(
    ms: Sequence[Model], w0: str, first: torch.Tensor | None, used: torch.Tensor | None
) -> None:
    """Each model's first-layer weights after its chunk trained: as it started where it started
    elsewhere (:attr:`Model.start`), then the trained ``first[i]`` (``(k, out)``; None: the layer
    is frozen) at its inputs ``used[i]`` (None: every input)."""
    with torch.no_grad():
        for i, m in enumerate(ms):
            dst = m.params[w0]
            if m.start is not None and (first is None or used is not None):
                dst.copy_(m.start[w0])
            if first is None:
                continue
            if used is None:
                dst.copy_(first[i].mT)
            else:  # the transposed view's rows are the weights' columns, one per input
                dst.mT.index_copy_(0, used[i], first[i])


def _train_stacked(
    names: list[str],
    layers: list[tuple[str, str, bool]],
    models: Sequence[Model],
    optimizer: str,
    lr: float,
    *,
    mu: Sequence[float] | None,
    anchors: Sequence[dict[str, torch.Tensor]] | None,
    loss_from: Sequence[int] | None,
    scratch: dict,
) -> list[float]:
    """:func:`train_exact`'s training (same batches, same losses and updates) with the models of
    a step in one stacked computation, a chunk of them (:func:`_models_per_chunk`) through all
    their steps at a time: each layer one batched matrix product over the models,
    batches padded to the step's largest (padded rows carry no gradient), one optimiser pass per
    parameter (Adam: torch's fused kernel), each model's first layer over the inputs its records
    use (:func:`_used_inputs`; the others' weights cannot move). Equal to the exact kernels up to
    float rounding (Adam amplifies it); returns the same per-model loss totals. Its large tensors
    (the stacked weights, Adam's moments, the records, every step's buffers) are ``scratch``'s,
    reused by the next call of a caller that keeps it (:mod:`privkit.batched.buffers`)."""
    trainable = set(names)
    n = len(models)
    if n == 0:
        return []
    # longest first: the models still training at step t are a prefix; among equally long
    # ones, those whose records use the most inputs first (a chunk's first layer is as wide as
    # its widest model needs, below)
    need = _needed(models)
    uses = need.sum(1).tolist()
    order = sorted(range(n), key=lambda j: (-models[j].steps, -uses[j]))
    ms = [models[j] for j in order]
    need = need[order]
    device, soft = ms[0].x.device, ms[0].soft
    if any(m.soft != soft for m in ms):
        raise ValueError("stacked models must all have label or all soft targets")
    every = list(ms[0].params)
    # Weights are held transposed, (models, in, out): the weight gradient is then the product
    # acts^T g written in the order its kernel fills fastest (the first layer's, 160 models'
    # (784 x 32) @ (32 x 64): 1.6x faster than g^T acts into (out, in)); the forward pass reads
    # them as it did. Adam's passes do not see the layout. The head below a hidden layer is the
    # exception (``head_t``): it keeps (models, classes, in) and its logits are taken transposed,
    # (models, classes, batch). A head's products have 10 columns, where the CPU's batched
    # kernels run a product at a time; transposed, the batch is their long side: a FedAvg
    # audit's step (16 models, batch 32, 64 hidden units, 10 classes) took 227 us in the head's
    # forward and backward passes and 105 us so (docs/performance.md).
    head_t = len(layers) > 1
    flip = {w for w, _, _ in (layers[:-1] if head_t else layers)}
    # the logits' class axis, and the index that puts a per-example factor along it
    c, per = (1, (slice(None), None)) if head_t else (2, (Ellipsis, None))
    weights = {w for w, _, _ in layers}
    # The first layer (the largest) is held per chunk only, picked from each model's start
    # (_FirstLayer); every other parameter is stacked for all models.
    w0 = layers[0][0]
    p = {
        k: _stacked([m.initial()[k] for m in ms], k in flip, scratch, ("params", k))
        for k in every
        if k != w0
    }
    starts0 = [m.initial()[w0] for m in ms]
    first_layer = _FirstLayer.of(starts0, scratch, "starts")
    mus = torch.tensor([0.0 if mu is None else float(mu[j]) for j in order], device=device)
    prox = bool((mus > 0).any())
    # Every proximal model that starts from its anchor itself (a reference run's clients start
    # from the round's global model, their anchor too): the stacked anchors are copies of the
    # stacked starts (the first layer's a chunk at a time, once narrowed: _Chunk), and no
    # weight differs from its anchor before the first step.
    from_anchor = prox and all(
        mus[i] == 0 or (m.start is not None and m.start is anchors[j])  # type: ignore[index]  # mu > 0: anchors
        for i, (j, m) in enumerate(zip(order, ms))
    )
    # each model's anchors where mu > 0; None for the others (mu 0 multiplies theirs)
    anchored = [
        anchors[j] if mus[i] > 0 else None  # type: ignore[index]  # mu > 0: anchors
        for i, j in enumerate(order)
    ]
    anchor = (
        {
            k: torch.stack(
                [
                    (a[k].mT if k in flip else a[k]) if a is not None else p[k][i]
                    for i, a in enumerate(anchored)
                ]
            )
            for k in names
            if k != w0
        }
        if prox and not from_anchor
        else {}
    )
    # the first layer's anchors, picked per chunk as its weights are (_FirstLayer)
    anchors0 = [None if a is None else a[w0] for a in anchored]
    anchor0 = (
        _FirstLayer.of(
            [s if a is None else a for a, s in zip(anchors0, starts0)], scratch, "anchors"
        )
        if prox and not from_anchor and w0 in trainable
        else None
    )
    first = torch.tensor(
        [math.inf if loss_from is None else float(loss_from[j]) for j in order], device=device
    )
    # Each model's first layer only over the inputs its records use (MNIST's clients leave about
    # a third of the 784 pixels at 0 in every record): an input that is 0 in every record gets a
    # zero weight gradient at every step, so Adam or SGD leaves its weights as they are (and the
    # proximal term's gradient, zero where the weights equal the anchor, keeps them there). The
    # first layer's products and its optimiser passes shrink with the unused inputs, each chunk
    # of models (below) to as many as its widest model needs; its weights are written into its
    # models' parameters after its last step (_put_back).
    if anchor0 is not None:  # from the anchor, none differs
        need = need | _off_anchor(starts0, anchors0)
    used, needs = _used_inputs(need)
    inputs_all, out0 = first_layer.weights.shape[1:]
    if from_anchor:  # the first layer's anchors are each chunk's narrowed starts
        anchor = {k: p[k].clone() for k in names if k != w0}
    m1 = {k: kept(scratch, ("m1", k), tuple(p[k].shape), p[k]).zero_() for k in names if k != w0}
    m2 = {k: kept(scratch, ("m2", k), tuple(p[k].shape), p[k]).zero_() for k in names if k != w0}
    steps = [m.steps for m in ms]
    sizes = [size for m in ms for size in m.sizes()]
    width = max(sizes, default=1)
    xs, ys, starts, y_starts = _records(ms, used, scratch)
    # (step, model, column) of every batch entry, padded to ``width``: one scatter, no loop.
    # Step-major: a chunk's models at step t are one contiguous slice ``[t, lo : lo + a]``.
    size = torch.tensor(sizes, dtype=torch.long)
    batch_model = torch.repeat_interleave(torch.arange(n), torch.tensor(steps))
    batch_step = torch.arange(len(sizes)) - torch.repeat_interleave(
        torch.tensor(steps).cumsum(0) - torch.tensor(steps), torch.tensor(steps)
    )
    entry_col = torch.arange(int(size.sum())) - torch.repeat_interleave(size.cumsum(0) - size, size)
    entry_model = torch.repeat_interleave(batch_model, size)
    idx = torch.zeros((steps[0], n, width), dtype=torch.long)
    y_idx = torch.zeros((steps[0], n, width), dtype=torch.long)  # the targets' rows
    at = (torch.repeat_interleave(batch_step, size), entry_model, entry_col)
    local = torch.cat([order.cpu() for m in ms for order in m.orders])
    idx[at] = local + starts[entry_model]
    y_idx[at] = local + y_starts[entry_model]
    counts = torch.zeros((steps[0], n))
    counts[batch_step, batch_model] = size.float()
    idx, counts = idx.to(device), counts.to(device)
    cols = torch.arange(width, device=device)
    totals = torch.zeros(n, dtype=torch.float64, device=device)
    # every step's per-model tensors formed once, not a few small operations a chunk and step:
    # the batches' targets, each row's factor -1 / batch size (0 on padding; models past their
    # last step get 0 everywhere), the step counts Adam reads, where the loss starts counting
    targets = ys[y_idx.to(device)]
    scales = -(cols < counts[..., None]).float() / counts.clamp_min(1.0)[..., None]
    step_counts = [torch.full((), float(t + 1), device=device) for t in range(steps[0])]
    counted_from = first.tolist()
    # The models train a chunk at a time, each chunk through all of its steps (the models are
    # independent): a chunk's weights, moments, records and step buffers stay in the CPU's cache
    # from step to step, where all models' (tens of MB for an audit's 160) came from memory at
    # every step. On this project's CPU the batched products of a chunk of 16 such models run at
    # 85 GFLOP/s, those of 160 at 52-58, and Adam's pass is 1.4x faster (docs/performance.md).
    # Every model goes through the same operations on the same operands as in one chunk (an
    # elementwise kernel may round a last bit differently with its tensor's size).
    # each parameter's output width (its last axis, but the transposed head's classes)
    outputs = out0 + sum(
        q.shape[1] if k in weights and k not in flip else q.shape[-1] for k, q in p.items()
    )
    narrowed = {**p, w0: torch.empty((n, xs.shape[1], out0), device="meta")}
    chunk = _models_per_chunk(narrowed, names, width, xs, n, outputs)
    # One proximal factor for every model (an audit's reference runs share their config): each
    # weight's proximal gradient goes into its gradient's product, mu times the difference as
    # the product's addend, rather than a pass of its own. The difference is exactly 0 where the
    # weights equal the anchor, so are both forms' gradients there (the inputs a batch does not
    # use, before their first use: Adam would turn any rounding residual into a step).
    pull = float(mus[0]) if prox and bool((mus == mus[0]).all()) else None
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        state = _Chunk.of(
            slice(lo, hi),
            p,
            m1,
            m2,
            anchor,
            w0=w0,
            first_layer=first_layer,
            anchor0=anchor0,
            names=names,
            used=used,
            inputs=inputs_all if used is None else max(1, max(needs[lo:hi])),
            from_anchor=from_anchor,
            scratch=scratch,
        )
        own, inputs = state.own, state.first.shape[1]
        records = xs if used is None else xs[:, :inputs]  # each row's first inputs: its model's
        # Each step's large tensors (the gathered batch, the hidden activations, the gradients,
        # the proximal differences) go to buffers made once, their first ``a`` rows a step's: a
        # fresh tensor is fresh pages from the system on every step, which cost more than the
        # arithmetic that fills them (measured in docs/performance.md).
        buffers = _StepBuffers(
            batch=kept(scratch, "batch", (chunk * width, inputs), xs),
            hidden=[
                kept(scratch, ("hidden", w), (chunk, width, own[w].shape[2]), xs)
                for w, _, _ in layers[:-1]
            ],
            grads={
                key: kept(scratch, ("grad", key), (chunk, *own[key].shape[1:]), own[key])
                for key in names
            },
            prox=(
                {
                    key: kept(scratch, ("prox", key), (chunk, *own[key].shape[1:]), own[key])
                    for key in names
                }
                if prox
                else {}
            ),
        )
        views: dict[int, _Live] = {}
        for t in range(steps[lo]):
            # the chunk's models still training at step t: its first a (longest first)
            a = sum(1 for s in steps[lo:hi] if s > t)
            if a not in views:  # the views change only where a model of the chunk stops
                views[a] = _Live.of(
                    slice(0, a),
                    width,
                    own,
                    state.m1,
                    state.m2,
                    mus[lo:hi],
                    state.anchor,
                    names,
                    buffers,
                )
            v = views[a]
            scale = scales[t, lo : lo + a]  # (a, width)
            x = torch.index_select(records, 0, idx[t, lo : lo + a].reshape(-1), out=v.batch).view(
                a, width, -1
            )
            y = targets[t, lo : lo + a]
            acts = [x]
            for (w, b, _), h in zip(layers[:-1], v.hidden):
                acts.append(torch.baddbmm(v.bias[b], acts[-1], v.own[w], out=h).relu_())
            w, b, _ = layers[-1]
            if head_t:  # logits (models, classes, batch)
                z = torch.baddbmm(v.column[b], v.own[w], acts[-1].mT)
            else:
                z = torch.baddbmm(v.bias[b], acts[-1], v.own[w])
            logp = log_softmax(z, c)
            rows = scale[per]  # each example's factor, broadcast along the class axis
            if soft:  # targets (models, batch, classes), read along the logits' axes
                y = y.mT if head_t else y
                g = y * rows
                g = g - logp.exp() * g.sum(c, keepdim=True)
            else:  # scale at the label minus softmax times scale (a one-hot row sums to scale)
                g = logp.exp().mul_(rows).neg_()
                g.scatter_add_(c, y[per], rows)
            for i in range(len(layers) - 1, -1, -1):
                w, b, below = layers[i]
                if w not in trainable:
                    break
                # the weight gradient's factors in the weight's layout: g^T acts for the
                # transposed head (g is (models, classes, batch) there), acts^T g for the others
                lhs, rhs = (g, acts[i]) if w not in flip else (acts[i].mT, g)
                if pull is None:
                    torch.bmm(lhs, rhs, out=v.grads[w])
                else:  # mu (theta - anchor) + the product in one (the weights' prox term)
                    d = torch.sub(v.own[w], v.anchor[w], out=v.grads[w])
                    d.baddbmm_(lhs, rhs, beta=pull)
                torch.sum(g, 2 if w not in flip else 1, out=v.grads[b])
                if below:  # through the layer, then ReLU's gradient (one kernel, not a mask)
                    back = torch.bmm(g.mT, v.own[w]) if w not in flip else g @ v.own[w].mT
                    g = torch.ops.aten.threshold_backward(back, acts[i], 0)
            count = any(f <= t for f in counted_from[lo : lo + a])
            # the proximal term's value, where the loss is counted
            extra = torch.zeros(a, device=device) if count and prox else None
            if prox:  # (mu/2) ||theta - anchor||^2: gradient mu (theta - anchor), added in place
                for k in names:
                    in_product = pull is not None and k in weights  # its gradient is in
                    if in_product and extra is None:
                        continue  # and its value is not counted at this step
                    d = torch.sub(v.own[k], v.anchor[k], out=v.prox[k])
                    if not in_product:
                        v.grads[k].addcmul_(v.mus[k], d)
                    if extra is not None:
                        extra += 0.5 * mus[lo : lo + a] * d.square_().flatten(1).sum(1)
            if count:  # the batch's mean loss: cross-entropy, or KL(targets || softmax) (batchmean)
                live = slice(lo, lo + a)
                if soft:
                    per_row = (torch.xlogy(y, y) - y * logp).sum(c)
                    mean = (per_row * -scale).sum(1)
                else:
                    mean = (logp.gather(c, y[per]).squeeze(c) * scale).sum(1)
                loss = mean if extra is None else mean + extra
                counted = t >= first[live]
                totals[live] += torch.where(counted, loss * counts[t, live], 0.0).double()
            if optimizer == "adam":
                adam_step(v.params, v.grad_list, v.m1, v.m2, step_counts[t], lr)
            else:
                _update(optimizer, lr, t + 1, v.params, v.grad_list, [], [])
        _put_back(  # the chunk's first layer into its models' parameters
            ms[lo:hi],
            w0,
            state.first if w0 in trainable else None,
            None if used is None else used[lo:hi, :inputs],
        )
    with torch.no_grad():  # the trained parameters, and those a model started elsewhere from
        for i, m in enumerate(ms):
            for k in every if m.start is not None else names:
                if k != w0:
                    m.params[k].copy_(p[k][i].mT if k in flip else p[k][i])
    out = [0.0] * n
    for i, j in enumerate(order):
        out[j] = float(totals[i])
    return out


@dataclass
class _Chunk:
    """The stacked state one chunk of models (the stacked rows ``rows``) trains in: every other
    parameter's, Adam moment's and proximal anchor's rows (views: they train in place), and the
    first layer's (``w0``) over the chunk's own ``inputs`` (its widest model's), picked from the
    models' starts (:class:`_FirstLayer`) into a buffer of ``scratch`` (a contiguous block:
    fused Adam reads its tensors as contiguous), with zeroed moments and its anchors picked
    (``anchor0``; or, for models that start from their anchor, copied from its start)."""

    own: dict[str, torch.Tensor]
    m1: dict[str, torch.Tensor]
    m2: dict[str, torch.Tensor]
    anchor: dict[str, torch.Tensor]
    first: torch.Tensor  # the first layer's weights, (models, inputs, out)

    @classmethod
    def of(
        cls,
        rows: slice,
        p: dict[str, torch.Tensor],
        m1: dict[str, torch.Tensor],
        m2: dict[str, torch.Tensor],
        anchor: dict[str, torch.Tensor],
        *,
        w0: str,
        first_layer: _FirstLayer,
        anchor0: _FirstLayer | None,
        names: list[str],
        used: torch.Tensor | None,
        inputs: int,
        from_anchor: bool,
        scratch: dict,
    ) -> _Chunk:
        w = first_layer.weights
        picked = None if used is None else used[rows, :inputs]
        buffer = kept(scratch, "first", (rows.stop - rows.start, inputs, w.shape[2]), w)
        first = _pick_rows(first_layer, rows, picked, buffer)
        own = {w0: first, **{key: q[rows] for key, q in p.items()}}
        m1c, m2c = ({key: q[rows] for key, q in m.items()} for m in (m1, m2))
        anc = {key: q[rows] for key, q in anchor.items()}
        if w0 in names:
            m1c[w0] = kept(scratch, ("m1", w0), tuple(first.shape), first).zero_()
            m2c[w0] = kept(scratch, ("m2", w0), tuple(first.shape), first).zero_()
            if from_anchor:
                anc[w0] = kept(scratch, ("anchor", w0), tuple(first.shape), first).copy_(first)
            elif anchor0 is not None:
                anc[w0] = _pick_rows(anchor0, rows, picked)
        return cls(own, m1c, m2c, anc, first)


@dataclass
class _StepBuffers:
    """:func:`_train_stacked`'s buffers for one step of a chunk (a step of ``a`` models writes
    their first ``a`` rows): the gathered batch, the hidden activations, the gradients and the
    proximal differences by parameter name."""

    batch: torch.Tensor
    hidden: list[torch.Tensor]
    grads: dict[str, torch.Tensor]
    prox: dict[str, torch.Tensor]


@dataclass
class _Live:
    """The views a step of the models ``live`` (a slice of the stacked ones) reads and writes,
    formed once per chunk and number of models still training: a step otherwise takes about 30
    tensor slices (102,600 in one FedAvg audit), a few microseconds each."""

    own: dict[str, torch.Tensor]  # every stacked parameter of the live models
    bias: dict[str, torch.Tensor]  # the biases as (models, 1, out), for the forward products
    column: dict[str, torch.Tensor]  # and as (models, out, 1), for the transposed head's
    params: list[torch.Tensor]  # the trainable ones, in ``names`` order (the optimiser's lists)
    grad_list: list[torch.Tensor]
    m1: list[torch.Tensor]
    m2: list[torch.Tensor]
    mus: dict[str, torch.Tensor]  # the proximal factor, broadcast to each parameter's shape
    batch: torch.Tensor
    hidden: list[torch.Tensor]
    grads: dict[str, torch.Tensor]
    prox: dict[str, torch.Tensor]
    anchor: dict[str, torch.Tensor]  # the proximal term's anchors of the live models

    @classmethod
    def of(
        cls,
        live: slice,
        width: int,
        p: dict[str, torch.Tensor],
        m1: dict[str, torch.Tensor],
        m2: dict[str, torch.Tensor],
        mus: torch.Tensor,
        anchor: dict[str, torch.Tensor],
        names: list[str],
        buffers: _StepBuffers,
    ) -> _Live:
        a = live.stop - live.start
        own = {k: q[live] for k, q in p.items()}
        grads = {k: g[:a] for k, g in buffers.grads.items()}
        return cls(
            own=own,
            bias={k: q.unsqueeze(1) for k, q in own.items() if q.dim() == 2},
            column={k: q.unsqueeze(2) for k, q in own.items() if q.dim() == 2},
            params=[own[k] for k in names],
            grad_list=[grads[k] for k in names],
            m1=[m1[k][live] for k in names],
            m2=[m2[k][live] for k in names],
            mus={k: mus[live].view(-1, *([1] * (p[k].dim() - 1))) for k in names},
            batch=buffers.batch[: a * width],
            hidden=[h[:a] for h in buffers.hidden],
            grads=grads,
            prox={k: d[:a] for k, d in buffers.prox.items()},
            anchor={k: q[live] for k, q in anchor.items()},
        )


#: the bytes of a chunk of models :func:`_train_stacked` trains through all their steps together
#: on the CPU: weights, gradients, Adam's two moments, records and one step's activations, within
#: the 16 MB share of the last-level cache one of two workers has on this project's CPU
CHUNK_BYTES = 12 * 2**20


def _models_per_chunk(
    p: dict[str, torch.Tensor],
    names: list[str],
    width: int,
    xs: torch.Tensor,
    n: int,
    outputs: int,
) -> int:
    """How many of the ``n`` stacked models (``p``: their parameters, ``names`` the trainable
    ones; ``xs``: all models' records; ``outputs``: the parameters' output widths summed) train
    together through their steps: all of them on a GPU (no cache to fit; fewer, larger
    kernels), else as many as fit :data:`CHUNK_BYTES`."""
    if xs.device.type != "cpu":
        return n
    # every parameter read, and the trainable ones' gradients and two moments
    per_model = sum(p[k][0].numel() for k in p) + 3 * sum(p[k][0].numel() for k in names)
    per_model += xs.shape[0] // n * xs.shape[1] + width * outputs
    return max(1, min(n, CHUNK_BYTES // (per_model * xs.element_size())))


def _distinct(tensors: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[int]]:
    """The distinct tensors of ``tensors`` (the same storage, shape and strides: a tensor given
    several times), and the index of each tensor's among them."""
    slot: dict[tuple, int] = {}
    uniq: list[torch.Tensor] = []
    which: list[int] = []
    for t in tensors:
        same = _layout(t)
        if same not in slot:
            slot[same] = len(uniq)
            uniq.append(t)
        which.append(slot[same])
    return uniq, which


def _stacked(
    tensors: list[torch.Tensor], transposed: bool, scratch: dict | None = None, key=None
) -> torch.Tensor:
    """``tensors`` stacked on a leading axis, each transposed (contiguous) when ``transposed``;
    into ``scratch[key]`` where a scratch is given. A tensor given several times (the global
    model all of a run's clients start from) is transposed once, then copied to its places."""
    uniq, which = _distinct(tensors)
    if len(uniq) < len(tensors):
        once = _stacked(uniq, transposed)
        where = torch.tensor(which, device=once.device)
        if scratch is None:
            return once.index_select(0, where)
        out = kept(scratch, key, (len(tensors), *once.shape[1:]), once)
        return torch.index_select(once, 0, where, out=out)
    parts = [t.mT for t in tensors] if transposed else tensors
    if scratch is None:
        return torch.stack(parts)
    first = parts[0]
    return torch.stack(parts, out=kept(scratch, key, (len(parts), *first.shape), first))


def adam_step(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    m1: list[torch.Tensor],
    m2: list[torch.Tensor],
    step: torch.Tensor,
    lr: float,
) -> None:
    """torch's fused Adam (privkit's ``make_optimizer`` settings) on ``params`` in place, at the
    optimiser's step ``step`` (a 0-d float tensor, counted from 1): one pass over each tensor, not
    the seven of the single-tensor form; the stacked kernels' update (not bit for bit the
    single-tensor one). The fused kernel reads each gradient in its parameter's memory layout, so
    a gradient in another (autograd's of a convolution weight: channels last) is made contiguous
    first; a contiguous one is passed as it is."""
    torch._fused_adam_(
        params,
        [g.contiguous() for g in grads],
        m1,
        m2,
        [],
        [step] * len(params),
        lr=lr,
        beta1=BETA1,
        beta2=BETA2,
        weight_decay=0.0,
        eps=EPS,
        amsgrad=False,
        maximize=False,
    )


def _update(
    optimizer: str,
    lr: float,
    step: int,
    p: list[torch.Tensor],
    g: list[torch.Tensor],
    m1: list[torch.Tensor],
    m2: list[torch.Tensor],
) -> None:
    """torch's single-tensor SGD or Adam update (at step ``step``) of one model's parameters."""
    if optimizer == "sgd":
        torch._foreach_add_(p, g, alpha=-lr)
        return
    torch._foreach_lerp_(m1, g, 1 - BETA1)
    torch._foreach_mul_(m2, BETA2)
    torch._foreach_addcmul_(m2, g, g, value=1 - BETA2)
    denom = torch._foreach_sqrt(m2)
    torch._foreach_div_(denom, (1 - BETA2**step) ** 0.5)
    torch._foreach_add_(denom, EPS)
    torch._foreach_addcdiv_(p, m1, denom, value=-lr / (1 - BETA1**step))


__all__ = [
    "Inputs",
    "Model",
    "adam_step",
    "architecture",
    "mlp_layers",
    "model_for",
    "stacked_logits",
    "train_exact",
]
