"""White-box audit of DP-SGD with gradient canaries (Nasr et al. 2021, 2023; Steinke, Nasr &
Jagielski 2023), in one training run.

The auditor makes ``m`` canary gradients, each a fixed vector of L2 norm ``clip_norm`` (the
largest a clipped record can contribute): ``dirac`` (one coordinate of the flattened parameters,
distinct per canary) or ``random`` (a uniformly random direction). Each canary is *included* by a
fair coin from the audit's own stream. An included canary is a record of the training data: at
every step it joins the batch with the mechanism's sampling rate ``q`` (its own Poisson draw,
which the auditor never sees) and, when it does, its gradient is added to the sum of clipped
gradients before the noise. The DP-SGD loop calls two methods per step::

    summed = canaries.inject(summed)      # clipped sum of the batch + sampled canaries
    released = summed + noise             # the loop's own noise
    canaries.observe(released)            # what the auditor sees of this step

:func:`attach_to_opacus` does this inside an opacus ``DPOptimizer`` (wrapping its
``add_noise``); :class:`privkit.trainers.dp_sgd_step.DpSgdStep` takes ``canaries=``.

What the auditor observes. With ``know_batch=True`` (default) the auditor also knows the clipped
sum of the other records in each step (it knows every other record and each intermediate model:
the adversary DP is defined against) and subtracts it, so each step gives it
``sum of sampled canaries + noise``. The batch of other records is drawn independently of the
canaries, so this view protects every canary exactly as the accountant assumes
(``SelfComposed(PoissonSampled(q, Gaussian(sigma)), T)`` per canary): a bound above the accounted
epsilon is a real violation. With ``know_batch=False`` the auditor sees only the released sum and
the other records' gradients act as extra noise (weaker, same validity).

Score of canary k: its direction's component of each observed step, ``x_t = <r_t, u_k> / C``.
``statistic="sum"`` adds them (Steinke et al.); ``"lr"`` adds the per-step log-likelihood ratio
of the claimed step, ``log(1 - q + q exp((x_t - 1/2) / sigma^2))``, the most powerful test of one
canary against the claimed subsampled Gaussian (Neyman-Pearson). Either way the one-run bound is
computed over the canaries alone (their coins are the only randomised inclusion).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from attacks.canaries import ONE_SIDED_GUESSES
from attacks.experiment import stream

KINDS = ("dirac", "random")
STATISTICS = ("auto", "sum", "lr")

__all__ = ["GradientCanaries", "attach_to_opacus"]

TensorLike = torch.Tensor | Sequence[torch.Tensor]


def _flat(tensors: TensorLike) -> torch.Tensor:
    if isinstance(tensors, torch.Tensor):
        return tensors.reshape(-1)
    return torch.cat([t.reshape(-1) for t in tensors])


class GradientCanaries:
    """``n`` gradient canaries for a DP-SGD run over ``dim`` parameters (see the module docstring).

    Parameters
    ----------
    dim : number of (trainable) parameters, flattened in the order the loop passes them.
    n : number of canaries (``dirac`` needs ``n <= dim``).
    clip_norm : the loop's clipping norm ``C``; every canary gradient has L2 norm ``C``.
    sample_rate : the loop's Poisson rate ``q``; an included canary joins each step with it.
    noise_multiplier : the *claimed* sigma (for ``statistic="lr"``); ``None`` allows ``sum`` only.
    kind : ``dirac`` or ``random``. Random directions overlap by about ``1/sqrt(dim)``, so each
        step adds cross-talk of about ``sqrt(q n / dim)`` clip norms to every score: use them with
        ``dim`` much larger than ``n``.
    know_batch : subtract the other records' clipped sum of each step (see the module docstring).
    seed : audit seed: coins, directions and the canaries' own sampling use separate streams.
    """

    def __init__(self, dim: int, n: int, *, clip_norm: float, sample_rate: float,
                 noise_multiplier: float | None = None, kind: str = "dirac", know_batch: bool = True,
                 seed: int = 0):
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}; found {kind!r}")
        if not isinstance(n, (int, np.integer)) or n < 2:
            raise ValueError(f"n (number of canaries) must be an integer >= 2; found {n!r}")
        if kind == "dirac" and n > dim:
            raise ValueError(f"n must be <= dim = {dim} for dirac canaries (one coordinate each); found {n}")
        if not clip_norm > 0 or not math.isfinite(clip_norm):
            raise ValueError(f"clip_norm must be a finite number > 0; found {clip_norm}")
        if not 0 < sample_rate <= 1:
            raise ValueError(f"sample_rate must be in (0, 1]; found {sample_rate}")
        if noise_multiplier is not None and noise_multiplier < 0:
            raise ValueError(f"noise_multiplier must be >= 0; found {noise_multiplier}")
        self.dim, self.n, self.kind, self.seed = int(dim), int(n), kind, int(seed)
        self.clip_norm, self.sample_rate = float(clip_norm), float(sample_rate)
        self.noise_multiplier = None if noise_multiplier is None else float(noise_multiplier)
        self.know_batch = know_batch
        self.included = stream(seed, "gradient-canaries/coins").random(self.n) < 0.5
        rng = stream(seed, "gradient-canaries/directions")
        if kind == "dirac":
            self._coords = torch.as_tensor(rng.choice(self.dim, self.n, replace=False), dtype=torch.long)
            self._u = None
        else:
            u = torch.as_tensor(rng.standard_normal((self.n, self.dim)), dtype=torch.float32)
            self._u = u / u.norm(dim=1, keepdim=True)
        # the canaries' Poisson sampling is the mechanism's randomness: its own stream, never scored
        self._sampling = torch.Generator().manual_seed(
            int(stream(seed, "gradient-canaries/sampling").integers(2**62)))
        self._inc = torch.as_tensor(self.included)
        self._sum = np.zeros(self.n)
        self._lr = np.zeros(self.n)
        self._clean: torch.Tensor | None = None
        self._pending = False
        self.steps = 0
        self.appearances = np.zeros(self.n, dtype=np.int64)  # diagnostics only; never in a score

    @classmethod
    def for_parameters(cls, params: Sequence[torch.Tensor], n: int, **kwargs) -> GradientCanaries:
        """Canaries over the trainable tensors ``params`` (their total number of entries)."""
        return cls(sum(int(p.numel()) for p in params if p.requires_grad), n, **kwargs)

    # ------------------------------------------------------------------ the two calls per step
    def inject(self, summed: TensorLike) -> TensorLike:
        """The clipped sum of this step plus the gradients of the included canaries sampled now.

        ``summed`` is a flat tensor or a list of tensors (the loop's parameter order); the same
        structure comes back. Call :meth:`observe` with the released (noisy) sum before the next
        ``inject``.
        """
        if self._pending:
            raise RuntimeError("inject called twice without observe: call observe(released) every step")
        flat = _flat(summed).detach()
        if flat.numel() != self.dim:
            raise ValueError(f"the summed gradient must have dim = {self.dim} entries; found {flat.numel()}")
        self._clean = flat.clone() if self.know_batch else None
        sampled = (torch.rand(self.n, generator=self._sampling) < self.sample_rate) & self._inc
        self.appearances += sampled.numpy()
        self._pending = True
        if not bool(sampled.any()):
            return summed
        add = self._direction_sum(sampled).to(device=flat.device, dtype=flat.dtype) * self.clip_norm
        if isinstance(summed, torch.Tensor):
            return summed + add.reshape(summed.shape)
        out, at = [], 0
        for t in summed:
            k = t.numel()
            out.append(t + add[at:at + k].reshape(t.shape))
            at += k
        return out

    def observe(self, released: TensorLike) -> None:
        """Score this step from the released sum (clipped sum + canaries + noise)."""
        if not self._pending:
            raise RuntimeError("observe called without inject: call inject(summed) first every step")
        r = _flat(released).detach().to(device="cpu", dtype=torch.float64)
        if self._clean is not None:
            r = r - self._clean.to(device="cpu", dtype=torch.float64)
        x = self._project(r) / self.clip_norm
        self._sum += x
        if self.noise_multiplier and self.sample_rate < 1:
            s2 = self.noise_multiplier ** 2
            self._lr += np.logaddexp(math.log1p(-self.sample_rate),
                                     math.log(self.sample_rate) + (x - 0.5) / s2)
        elif self.noise_multiplier:
            self._lr += (x - 0.5) / self.noise_multiplier ** 2
        self._clean, self._pending = None, False
        self.steps += 1

    # ------------------------------------------------------------------ scores and the audit
    def scores(self, statistic: str = "auto") -> np.ndarray:
        """Per-canary score (higher = included): ``sum`` or ``lr`` (``auto``: ``lr`` when the
        claimed sigma is known and positive)."""
        if statistic not in STATISTICS:
            raise ValueError(f"statistic must be one of {', '.join(STATISTICS)}; found {statistic!r}")
        if statistic == "auto":
            statistic = "lr" if self.noise_multiplier else "sum"
        if statistic == "lr" and not self.noise_multiplier:
            raise ValueError(f"statistic 'lr' needs the claimed noise_multiplier > 0; found {self.noise_multiplier}")
        return (self._lr if statistic == "lr" else self._sum).copy()

    def audit(self, *, accounted_epsilon: float | None, delta: float, confidence: float = 0.95,
              seed: int | None = None, statistic: str = "auto", guesses=ONE_SIDED_GUESSES, **kwargs):
        """The one-run audit over the canaries alone (:func:`attacks.audit_scores`, ``inclusion``
        random; guesses :data:`attacks.canaries.ONE_SIDED_GUESSES`); ``kwargs`` go to it (``curve``)."""
        from attacks.audit_scores import audit_scores

        if self.steps == 0:
            raise ValueError("no step was observed; run the training loop with these canaries first")
        stat = "lr" if statistic == "auto" and self.noise_multiplier else (
            "sum" if statistic == "auto" else statistic)
        name = f"gradient-canaries-{self.kind}"
        note = (f"{self.n} {self.kind} gradient canaries (norm {self.clip_norm:g}, sampled at q = "
                f"{self.sample_rate:g} per step over {self.steps} steps), {int(self.included.sum())} "
                f"included by fair coins; score = {stat} of each step's component along the canary"
                + ("" if self.know_batch else "; the other records' gradients not subtracted"))
        return audit_scores({name: self.scores(stat)}, self.included, accounted_epsilon=accounted_epsilon,
                            delta=delta, confidence=confidence, seed=self.seed if seed is None else seed,
                            inclusion="random", notes={name: note}, guesses=guesses, **kwargs)

    def summary(self) -> dict:
        inc = self.included
        return {"kind": self.kind, "canaries": self.n, "included": int(inc.sum()), "steps": self.steps,
                "clip_norm": self.clip_norm, "sample_rate": self.sample_rate,
                "claimed_noise_multiplier": self.noise_multiplier, "know_batch": self.know_batch,
                "mean_appearances_included": float(self.appearances[inc].mean()) if inc.any() else 0.0,
                "seed": self.seed}

    # ------------------------------------------------------------------ internals
    def _direction_sum(self, sampled: torch.Tensor) -> torch.Tensor:
        if self._u is None:
            out = torch.zeros(self.dim)
            out[self._coords[sampled]] = 1.0
            return out
        return self._u[sampled].sum(0)

    def _project(self, r: torch.Tensor) -> np.ndarray:
        if self._u is None:
            return r[self._coords].numpy()
        return (self._u.to(torch.float64) @ r).numpy()


def attach_to_opacus(optimizer, canaries: GradientCanaries):
    """Insert ``canaries`` into every step of an opacus ``DPOptimizer`` (returns the optimizer).

    opacus computes ``p.summed_grad`` (clipped sum) in ``clip_and_accumulate`` and
    ``p.grad = p.summed_grad + noise`` in ``add_noise``, before ``scale_grad`` divides by the
    expected batch size. The wrapper adds the canaries to ``summed_grad`` just before the noise
    and observes ``p.grad`` just after it, so the accountant hook opacus attaches to ``step`` is
    untouched. A step opacus skips (no per-sample gradients) inserts and observes nothing.
    """
    original = optimizer.add_noise
    params = list(optimizer.params)
    if sum(p.numel() for p in params) != canaries.dim:
        raise ValueError(f"canaries are over dim = {canaries.dim} entries but the optimizer has "
                         f"{sum(p.numel() for p in params)}")
    if abs(getattr(optimizer, "max_grad_norm", canaries.clip_norm) - canaries.clip_norm) > 1e-12:
        raise ValueError(f"canaries' clip_norm {canaries.clip_norm} differs from the optimizer's "
                         f"max_grad_norm {optimizer.max_grad_norm}")

    def add_noise() -> None:
        summed = [p.summed_grad for p in params]
        for p, before, after in zip(params, summed, canaries.inject(summed)):
            if after is not before:  # in place: opacus marks summed_grad as processed
                p.summed_grad.add_(after - before)
        original()
        canaries.observe([p.grad for p in params])

    optimizer.add_noise = add_noise
    return optimizer
