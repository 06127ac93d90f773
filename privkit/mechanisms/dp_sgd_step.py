"""One DP-SGD step (Abadi et al. 2016) with Poisson sampling, shared by every DP-SGD method.

The step is exactly what the subsampled-Gaussian accountant assumes
(``PoissonSampledDpEvent(q, GaussianDpEvent(noise_multiplier))`` under add/remove-one neighbours):

1. **Poisson sampling**: each of the ``n`` records joins the batch independently with
   probability ``q`` (:func:`poisson_batch`). A fixed-size shuffled batch would *not* match the
   accounting (see the sampling-mismatch notes: Chua et al. 2024).
2. **Per-sample gradients**, so no record's gradient depends on another's (the models have no
   BatchNorm): for privkit's models the per-record norms and the clipped sum come from each
   layer's inputs and output gradients (:func:`privkit.mechanisms.stacked.clipped_sum_one`; no
   per-record weight gradients of linear layers are formed), for other models of linear, 1-d
   and 2-d convolution, GroupNorm/LayerNorm/RMSNorm, embedding and batch-first
   ``nn.MultiheadAttention`` layers (a layer run several times, an RNN's cells, included), linear
   layers of the model's own (HF's ``Conv1D`` in GPT-2), embedding subclasses (HF's scaled word
   embeddings), bare parameters of the model's own modules (a vision transformer's class token)
   and an output
   layer tied to the embedding, by book-keeping ghost clipping
   (:mod:`privkit.mechanisms.ghost_clipping`: one forward and one backward pass), for any other
   model from ``torch.func`` (``vmap(grad(loss))``); they agree up to float rounding (tested).
3. **Clipping** of each record's whole gradient to L2 norm ``clip_norm`` (flat clipping).
4. **Noise**: ``N(0, (noise_multiplier * clip_norm)^2 I)`` added to the *sum* of clipped gradients,
   then divided by the *expected* batch size ``q * n`` (as opacus does for Poisson sampling):
   dividing by the realised batch size would make the scale data-dependent.

An empty Poisson batch still releases a pure-noise gradient, as the analysis assumes. Batches and
noise are drawn from a :class:`privkit.mechanisms.dp_random.DpRandom` (the AES stream in release mode, where
the noisy sum lies on the data-independent grid of :mod:`privkit.mechanisms.grid_noise`); a plain
``torch.Generator`` is accepted too and drawn from as torch draws.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from privkit.errors import PrivkitError
from privkit.mechanisms import mutations
from privkit.mechanisms.dp_random import DpRandom
from privkit.mechanisms.gaussian import Receipt, gaussian_release

if TYPE_CHECKING:
    from privkit.mechanisms.step_replay import StepReplay

# loss_fn(logits (1, C), target (1,), aux (1, ...) or None) -> scalar loss of ONE record
PerSampleLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
"""``loss_fn(logits (1, C), target (1,), aux (1, ...) or None)``: the scalar loss of one record."""

__all__ = [
    "ClippingFallbackWarning",
    "DpSgdStep",
    "PerSampleLoss",
    "clip_per_sample",
    "clipped_gradient_sum",
    "per_sample_gradients",
    "poisson_batch",
]


def _coins_on_device(source: DpRandom, canaries) -> bool:
    """Whether a step draws its canaries' coins on the device and keeps them there: a seeded torch
    generator off the CPU (whose draws :meth:`DpRandom.mask` would copy back, waiting for the
    device) and Dirac canaries (a coordinate each)."""
    gen = source.source
    return (
        isinstance(gen, torch.Generator) and gen.device.type != "cpu" and canaries.kind == "dirac"
    )


def poisson_batch(
    n: int, sample_rate: float, generator: DpRandom | torch.Generator
) -> torch.Tensor:
    """Indices of a Poisson-sampled batch: each of ``n`` records joins with probability ``sample_rate``.

    A torch ``generator`` must live on the CPU (sampling is cheap; keeping it there keeps results
    identical across devices).

    Parameters
    ----------
    n : int
        The number of records (``>= 0``).
    sample_rate : float
        Each record's inclusion probability ``q``, in ``(0, 1]``.
    generator : DpRandom or torch.Generator
        The stream the ``n`` Bernoulli draws come from.

    Returns
    -------
    torch.Tensor
        The sampled indices in increasing order (int64, CPU).
    """
    if not 0.0 < sample_rate <= 1.0:
        raise PrivkitError(f"sample_rate must be in (0, 1]; found {sample_rate}")
    if n < 0:
        raise PrivkitError(f"n must be >= 0; found {n}")
    mask = DpRandom.of(generator).mask(n, rate=sample_rate)
    return torch.nonzero(mask, as_tuple=False).flatten()


def per_sample_gradients(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    loss_fn: PerSampleLoss,
    aux: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Gradient of ``loss_fn`` for each record separately: ``{name: (B, *param.shape)}``.

    Parameters
    ----------
    model : torch.nn.Module
        The model; only parameters with ``requires_grad`` are differentiated.
    x : torch.Tensor
        The batch's inputs, one record per row (``B`` rows, possibly 0).
    y : torch.Tensor
        The batch's targets, ``(B,)``.
    loss_fn : PerSampleLoss
        ``loss_fn(logits (1, C), target (1,), aux (1, ...) or None)``: one record's scalar loss.
    aux : torch.Tensor, optional
        A per-record tensor passed to ``loss_fn`` (e.g. a teacher's logits for distillation).
    """
    params = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}
    buffers = {k: v.detach() for k, v in model.named_buffers()}

    def one(p, xi, yi, ai):
        logits = functional_call(model, (p, buffers), (xi.unsqueeze(0),))
        return loss_fn(logits, yi.unsqueeze(0), None if ai is None else ai.unsqueeze(0))

    in_dims = (None, 0, 0, 0 if aux is not None else None)
    return vmap(grad(one), in_dims=in_dims, randomness="error")(params, x, y, aux)


def clip_per_sample(
    grads: dict[str, torch.Tensor], clip_norm: float
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Scale each record's gradient (all parameters together) to L2 norm at most ``clip_norm``.

    Returns the clipped per-sample gradients and the per-sample norms *before* clipping.
    Factor ``min(1, c / ||g||)`` as in Abadi et al. (opacus adds 1e-6 to the norm; we guard 0 only).
    """
    if clip_norm <= 0:
        raise PrivkitError(f"clip_norm must be > 0; found {clip_norm}")
    first = next(iter(grads.values()))
    b = first.shape[0]
    sq = torch.zeros(b, dtype=first.dtype, device=first.device)
    for g in grads.values():
        sq = sq + g.reshape(b, -1).pow(2).sum(1)
    norms = sq.sqrt()
    factor = torch.clamp(clip_norm / torch.clamp(norms, min=1e-12), max=1.0)
    clipped = {k: g * factor.view(-1, *([1] * (g.dim() - 1))) for k, g in grads.items()}
    return clipped, norms


def clipped_gradient_sum(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    loss_fn: PerSampleLoss,
    clip_norm: float,
    aux: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """``sum_i min(1, c / ||g_i||) g_i`` over the trainable parameters (``g_i``: record i's gradient).

    privkit's own models take the stacked layers (:func:`privkit.mechanisms.stacked.clipped_sum_one`),
    any other model of linear, 1-d, 2-d and 3-d convolution (transposed too),
    GroupNorm/LayerNorm/RMSNorm, InstanceNorm, BatchNorm in eval mode, PReLU, embedding (and
    EmbeddingBag), recurrent (LSTM, GRU, RNN) and batch-first ``nn.MultiheadAttention`` layers (and linear layers and bare
    parameters of its own modules) book-keeping ghost clipping
    (:mod:`privkit.mechanisms.ghost_clipping`; torch's other one-input layers among them, an
    EmbeddingBag in ``max`` mode, by ``torch.func`` on that layer alone), anything else ``torch.func`` per-example gradients of the whole model; all three
    agree up to float rounding (tested). A model with BatchNorm on the batch's statistics is
    refused (:class:`~privkit.errors.PrivkitError`): no record's gradient is its own.

    Parameters
    ----------
    model : torch.nn.Module
        The model; only parameters with ``requires_grad`` are differentiated.
    x : torch.Tensor
        The batch's inputs, one record per row (``B`` rows, possibly 0).
    y : torch.Tensor
        The batch's targets, ``(B,)``.
    loss_fn : PerSampleLoss
        ``loss_fn(logits (1, C), target (1,), aux (1, ...) or None)``: one record's scalar loss.
    clip_norm : float
        The L2 clipping norm ``c`` of each record's whole gradient (``> 0``; ``inf``: no
        clipping).
    aux : torch.Tensor, optional
        A per-record tensor passed to ``loss_fn`` (e.g. a teacher's logits for distillation).
    weights : torch.Tensor, optional
        ``(B,)`` zeros and ones: each record's loss times its weight, so that a row of weight 0
        (a batch padded to a fixed size: :mod:`privkit.mechanisms.step_replay`) has gradient 0
        and adds exactly nothing; rows of weight 1 are unchanged, bit for bit.

    Returns
    -------
    dict of str to torch.Tensor
        The clipped sum of each trainable parameter, by name.
    """
    from privkit.mechanisms import batch_statistics, ghost_clipping
    from privkit.mechanisms.clip_precision import compute_dtype, full_precision
    from privkit.mechanisms.stacked import UnsupportedModelError, clipped_sum_one

    if clip_norm <= 0:
        raise PrivkitError(f"clip_norm must be > 0; found {clip_norm}")

    def one(lo: torch.Tensor, t: torch.Tensor, a: torch.Tensor | None) -> torch.Tensor:
        return loss_fn(lo.unsqueeze(0), t.unsqueeze(0), None if a is None else a.unsqueeze(0))

    def example_losses(logits: torch.Tensor, s: slice) -> torch.Tensor:
        losses = vmap(one, in_dims=(0, 0, 0 if aux is not None else None))(
            logits, y[s], None if aux is None else aux[s]
        )
        return losses if weights is None else losses * weights[s].to(losses.dtype)

    try:
        # privkit's own layers in their parameters' dtype under autocast: each example's norm
        # and contribution from the same values (ghost clipping's stored values are cast up)
        with full_precision(x.device):
            return clipped_sum_one(model, x, example_losses, clip_norm)
    except UnsupportedModelError:  # not privkit's own layers: any model of common layers
        pass
    try:
        return ghost_clipping.clipped_sum(model, x, example_losses, clip_norm)
    except UnsupportedModelError as why:  # a layer ghost clipping does not cover: torch.func
        mixing = batch_statistics.batch_statistics_layers(model)
        if mixing:  # torch.func would clip each example's own, other function
            raise PrivkitError(batch_statistics.refusal(type(model).__name__, mixing)) from None
        kept = batch_statistics.batch_statistics_layers(model, kept=True)
        if kept:  # torch.func would clip right and leave the batches' statistics in the model
            message = batch_statistics.refusal(type(model).__name__, kept, kept=True)
            raise PrivkitError(message) from None
        warnings.warn(
            f"per-example gradients by torch.func for {type(model).__name__} ({why}): the "
            "same clipped sum, slower, with every example's gradient held",
            ClippingFallbackWarning,
            stacklevel=3,
        )
        per = per_sample_gradients(model, x, y, loss_fn, aux)
        # a half-precision parameter's norms and sums in float32 (clip_precision)
        per = {k: g.to(compute_dtype(g.dtype)) for k, g in per.items()}
        clipped, _ = clip_per_sample(per, clip_norm)
        if weights is not None:  # a padded row's gradient zeroed after its clipping
            clipped = {
                k: g * weights.to(g.dtype).view(-1, *([1] * (g.dim() - 1)))
                for k, g in clipped.items()
            }
        return {k: g.sum(0) for k, g in clipped.items()}


class ClippingFallbackWarning(UserWarning):
    """DP-SGD's clipped sum of a model comes from ``torch.func`` per-example gradients: a layer or
    a use of one that book-keeping ghost clipping does not cover (the warning names it). The
    result is the same up to float rounding; the step is slower and holds every example's
    gradient. Shown once per reason and place (Python's default warning filter)."""


@dataclass(frozen=True)
class DpSgdStep:
    """DP-SGD with Poisson sampling: ``noisy_gradient`` returns ``(sum_i clip(g_i) + N(0, s^2 c^2 I)) / (q n)``.

    Parameters
    ----------
    clip_norm : float
        The per-record L2 clipping norm ``c`` (``> 0``).
    noise_multiplier : float
        ``sigma`` (``>= 0``); the noise std is ``sigma * c``.
    sample_rate : float
        The Poisson rate ``q`` (the accountant's ``q``), in ``(0, 1]``.
    dataset_size : int
        ``n``, the number of records the batch is drawn from.

    Notes
    -----
    Mixed precision: call :meth:`apply` inside ``torch.autocast`` as plain training runs its
    forward pass; each record's norm and clipped gradient are formed in float32 from the pass's
    half-precision values, and the noise is added in float32, so that no record contributes more
    than ``c``. A model held in bfloat16 or float16 alike; its noisy gradient is rounded to the
    parameter's dtype after (post-processing).

    In a training loop of a large model on a CPU, call :func:`privkit.memory.keep_freed_memory`
    once (``privkit``'s command line does): with glibc's own policy each step's large tensors are
    fresh pages, faulted in and zeroed. GPT-2 small's step (124M parameters, release noise) took
    8.67 s with it off and 4.11 s with it on (``benchmarks/results/dpsgd_step_cpu_gpt2_small*``).
    """

    clip_norm: float
    noise_multiplier: float
    sample_rate: float
    dataset_size: int

    def __post_init__(self) -> None:
        if self.clip_norm <= 0:
            raise PrivkitError(f"clip_norm must be > 0; found {self.clip_norm}")
        if self.noise_multiplier < 0:
            raise PrivkitError(f"noise_multiplier must be >= 0; found {self.noise_multiplier}")
        if not 0.0 < self.sample_rate <= 1.0:
            raise PrivkitError(f"sample_rate must be in (0, 1]; found {self.sample_rate}")
        if self.dataset_size < 1:
            raise PrivkitError(f"dataset_size must be >= 1; found {self.dataset_size}")

    @property
    def expected_batch_size(self) -> float:
        return self.sample_rate * self.dataset_size

    def sample(self, generator: DpRandom | torch.Generator) -> torch.Tensor:
        """A Poisson batch of record indices (a torch generator must be on the CPU)."""
        return poisson_batch(self.dataset_size, self.sample_rate, generator)

    def clip_factor(self, norms: torch.Tensor) -> torch.Tensor:
        """Each record's clipping factor ``min(1, c / ||g||)`` (1 when an audit's mutation switched
        clipping off: :mod:`privkit.mechanisms.mutations`)."""
        if not mutations.active().clipping:
            return torch.ones_like(norms)
        return (self.clip_norm / norms.clamp_min(1e-12)).clamp(max=1.0)

    def noisy_gradient(
        self,
        model: nn.Module,
        x: torch.Tensor,
        y: torch.Tensor,
        loss_fn: PerSampleLoss,
        noise_generator: DpRandom | torch.Generator,
        aux: torch.Tensor | None = None,
        canaries=None,
        receipts: list[Receipt] | None = None,
        replay: StepReplay | None = None,
    ) -> dict[str, torch.Tensor]:
        """The privatised mean gradient of the batch ``(x, y)`` (may be empty).

        The noise is drawn by :func:`privkit.mechanisms.gaussian_release`; its receipt (the
        subsampled Gaussian event of this step) is appended to ``receipts`` where given, for the
        trainer's ledger.

        ``canaries`` (an :class:`attacks.whitebox.GradientCanaries` over the trainable parameters,
        in ``named_parameters`` order) are records of this step: each included canary joins the
        batch with this step's sampling rate (drawn from ``noise_generator``) and its raw gradient
        (norm ``canaries.raw_norm``) is clipped as every record's is, before the noise; the
        canaries then observe the noisy sum. That is the white-box audit of this step, tested
        against what the ledger claims (:mod:`attacks.conformance`).

        Parameters
        ----------
        model : torch.nn.Module
            The model; the gradient is over its trainable parameters (``requires_grad``).
        x : torch.Tensor
            The sampled batch's inputs (:meth:`sample`'s records; may be empty).
        y : torch.Tensor
            The sampled batch's targets, ``(B,)``.
        loss_fn : PerSampleLoss
            ``loss_fn(logits (1, C), target (1,), aux (1, ...) or None)``: one record's scalar loss.
        noise_generator : DpRandom or torch.Generator
            The stream of the Gaussian noise and of the canaries' sampling.
        aux : torch.Tensor, optional
            A per-record tensor passed to ``loss_fn`` (e.g. a teacher's logits for distillation).
        canaries : attacks.whitebox.GradientCanaries, optional
            The audit's canaries for this step (:meth:`probes`); ``None`` outside an audit.
        receipts : list of Receipt, optional
            Where this step's receipt is appended, for the trainer's ledger.
        replay : StepReplay, optional
            Replay the clipped sum by batch size (:mod:`privkit.mechanisms.step_replay`: the
            host's work of a step cut to its operations; the same values up to float rounding).

        Returns
        -------
        dict of str to torch.Tensor
            The noisy sum divided by the expected batch size ``q n``, by parameter name.
        """
        mutation = mutations.active()
        clip = self.clip_norm if mutation.clipping else math.inf
        params = {k: v for k, v in model.named_parameters() if v.requires_grad}
        if len(y) > 0 and replay is not None:
            total = replay.clipped_sum(model, x, y, loss_fn, clip, aux)
        elif len(y) > 0:
            total = clipped_gradient_sum(model, x, y, loss_fn, clip, aux)
        else:  # an empty Poisson batch releases noise only
            from privkit.mechanisms.clip_precision import compute_dtype

            total = {
                k: torch.zeros_like(p, dtype=compute_dtype(p.dtype)) for k, p in params.items()
            }
        clean = None
        if canaries is not None:  # at the sampled canaries' coordinates only
            from attacks.whitebox import joined_on

            clean = [total[k] for k in params]
            source = DpRandom.of(noise_generator)
            if (
                clean
                and joined_on(clean[0].device)
                and len({(t.dtype, t.device) for t in clean}) == 1  # one vector holds them all
            ):
                total, restore = self._joined_with_canaries(total, list(params), canaries, source)
            else:
                restore = self._with_canaries(total, list(params), canaries, source)
        noisy, receipt = gaussian_release(
            total,
            std=self.noise_multiplier * self.clip_norm,
            sensitivity=self.clip_norm,
            source=noise_generator,
            sample_rate=self.sample_rate,
        )
        if receipts is not None:
            receipts.append(receipt)
        if canaries is not None:
            restore()  # the clipped sum again, bit for bit: what the canaries observe against
            canaries.observe([noisy[k] for k in params], clean=clean)
        # one multi-tensor division (one launch on a GPU), the same quotients as tensor by tensor
        names = list(noisy)
        if not names:  # the multi-tensor operations refuse an empty list
            return {}
        means = torch._foreach_div([noisy[k] for k in names], self.expected_batch_size)
        return dict(zip(names, means, strict=True))

    def _canary_addition(self, canaries, source: DpRandom) -> tuple[torch.Tensor, torch.Tensor]:
        """The included canaries this step samples, each clipped like a record, as ``(flat
        coordinates, values)`` (:meth:`attacks.whitebox.GradientCanaries.sparse_addition`)."""
        sampled = source.mask(len(canaries.included_ids), rate=self.sample_rate)
        return canaries.sparse_addition(sampled.to(torch.float32) * self._canary_weight(canaries))

    def _canary_weight(self, canaries) -> torch.Tensor:
        """What each included canary adds when sampled: its raw gradient norm clipped as a
        record's, ``clip_factor(raw) * raw`` (float32, one per included canary; times the 0 or 1
        of its coin, the same floats in either order)."""
        raw = torch.full((len(canaries.included_ids),), canaries.raw_norm)
        return self.clip_factor(raw) * raw

    def _canary_addition_on_device(
        self, canaries, source: DpRandom, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_canary_addition` where a seeded generator on a device draws the canaries'
        coins (:meth:`DpRandom.mask`'s draw, left there): every included canary's coordinate,
        its weight zero where it was not sampled (adding zero changes no value). The coins reach
        the host with the release's one copy
        (:meth:`attacks.whitebox.GradientCanaries.sampled_on_device`): read back here, they made
        the host wait for the step's forward and backward passes."""
        from attacks.transfers import to_device

        gen = cast(torch.Generator, source.source)
        n = len(canaries.included_ids)
        sampled = torch.rand(n, generator=gen, device=gen.device) < self.sample_rate
        canaries.sampled_on_device(sampled)
        weight = to_device(self._canary_weight(canaries), device)
        return canaries.included_coordinates_on(device), sampled.to(device) * weight

    def _with_canaries(
        self, total: dict[str, torch.Tensor], names: list[str], canaries, source: DpRandom
    ) -> Callable[[], None]:
        """Add to ``total`` (in place) the included canaries this step samples, each clipped like a
        record; returns the function that takes them out again
        (:meth:`attacks.whitebox.GradientCanaries.add_in_place`: the canaries' coordinates only,
        on the tensors' device, no dense vector)."""
        sampled = source.mask(len(canaries.included_ids), rate=self.sample_rate)
        weights = sampled.to(torch.float32) * self._canary_weight(canaries)
        return canaries.add_in_place([total[k] for k in names], weights)

    def _joined_with_canaries(
        self, total: dict[str, torch.Tensor], names: list[str], canaries, source: DpRandom
    ) -> tuple[dict[str, torch.Tensor], Callable[[], None]]:
        """Off the CPU: ``total`` joined into one vector (one copy, cheap on a device) with the
        sampled canaries added by one ``index_add_``, as views by name; ``total`` itself is left
        as it was, so nothing needs putting back. In place, a copy of what each touched tensor
        held, the addition and the restore took three launches per tensor (the canaries' fixed
        cost of a small model's step on a GPU). The values are :meth:`_with_canaries`'s bit for
        bit (the same float32 additions at distinct coordinates)."""
        from attacks.transfers import to_device

        flat = torch.cat([total[k].reshape(-1) for k in names])
        if _coins_on_device(source, canaries):
            coords, values = self._canary_addition_on_device(canaries, source, flat.device)
        else:
            coords, values = self._canary_addition(canaries, source)
            # queued behind the step's kernels (a plain copy to a GPU waits for all of them first)
            coords, values = to_device(coords, flat.device), to_device(values, flat.device)
        flat.index_add_(0, coords, values.to(flat.dtype))
        joined, at = dict(total), 0
        for k in names:
            n = total[k].numel()
            joined[k] = flat[at : at + n].view_as(total[k])
            at += n
        return joined, lambda: None

    def probes(self, model: nn.Module, client: int, label: str = "dp-sgd"):
        """The audit canaries this step must take for ``client``'s mechanism ``label`` (``None``
        unless an audit is probing: :func:`privkit.mechanisms.probes.canaries_for`), over ``model``'s
        trainable parameters, with this step's claimed parameters.

        Parameters
        ----------
        model : torch.nn.Module
            The trained model: the canaries' dimension is its trainable parameter count.
        client : int
            The client training it.
        label : str
            The mechanism's ledger label.
        """
        from privkit.mechanisms.probes import active, canaries_for

        if not active():  # no audit probing: the parameter count is not needed (a walk of the
            return None  # module tree per client and round, 1,000 in a dp-fedavg audit)
        dim = sum(int(p.numel()) for p in model.parameters() if p.requires_grad)
        return canaries_for(
            client,
            label,
            dim=dim,
            clip_norm=self.clip_norm,
            sample_rate=self.sample_rate,
            noise_multiplier=self.noise_multiplier,
        )

    def apply(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        x: torch.Tensor,
        y: torch.Tensor,
        loss_fn: PerSampleLoss,
        noise_generator: DpRandom | torch.Generator,
        aux: torch.Tensor | None = None,
        canaries=None,
        receipts: list[Receipt] | None = None,
        replay: StepReplay | None = None,
    ) -> None:
        """Write the noisy gradient into ``.grad`` and take one optimiser step (post-processing);
        the step's receipt goes to ``receipts`` where given.

        Parameters
        ----------
        model : torch.nn.Module
            The model; its trainable parameters (``requires_grad``) get the gradient and the
            step.
        optimizer : torch.optim.Optimizer
            The optimiser over ``model``'s parameters: stepped once, then its gradients set to
            ``None``.
        x : torch.Tensor
            The sampled batch's inputs (:meth:`sample`'s records; may be empty).
        y : torch.Tensor
            The sampled batch's targets, ``(B,)``.
        loss_fn : PerSampleLoss
            ``loss_fn(logits (1, C), target (1,), aux (1, ...) or None)``: one record's scalar loss.
        noise_generator : DpRandom or torch.Generator
            The stream of the Gaussian noise and of the canaries' sampling.
        aux : torch.Tensor, optional
            A per-record tensor passed to ``loss_fn`` (e.g. a teacher's logits for distillation).
        canaries : attacks.whitebox.GradientCanaries, optional
            The audit's canaries for this step (:meth:`probes`); ``None`` outside an audit.
        receipts : list of Receipt, optional
            Where this step's receipt is appended, for the trainer's ledger.
        replay : StepReplay, optional
            Replay the clipped sum by batch size (:mod:`privkit.mechanisms.step_replay`), one
            :class:`~privkit.mechanisms.step_replay.StepReplay` kept for the training.
        """
        g = self.noisy_gradient(
            model, x, y, loss_fn, noise_generator, aux, canaries, receipts, replay
        )
        for k, p in model.named_parameters():
            if p.requires_grad:  # (a half-precision parameter's noisy gradient rounded to it)
                p.grad = g[k].detach().to(p.dtype)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
