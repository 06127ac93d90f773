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
``add_noise``); :class:`privkit.mechanisms.dp_sgd_step.DpSgdStep` takes ``canaries=``.

What the auditor observes. With ``know_batch=True`` (default) the auditor also knows the clipped
sum of the other records in each step (it knows every other record and each intermediate model:
the adversary DP is defined against) and subtracts it, so each step gives it
``sum of sampled canaries + noise``. The batch of other records is drawn independently of the
canaries, so this view protects every canary exactly as the accountant assumes
(``SelfComposed(PoissonSampled(q, Gaussian(sigma)), T)`` per canary): a bound above the accounted
epsilon is a real violation. With ``know_batch=False`` the auditor sees only the released sum and
the other records' gradients act as extra noise (weaker, same validity).

Canaries at the mechanism. A DP primitive that samples and clips its records itself (privkit's
``DpSgdStep``, its Gaussian output perturbation) treats the canaries as records instead::

    w = sampled * clip_factor(raw_norm) * raw_norm     # the mechanism's own sampling and clipping
    released = clean + canaries.vector(w) + noise      # vector: sum_k w_k u_k over included canaries
    canaries.observe(released, clean=clean)

A loop adds ``vector(w)`` only where it is not zero: :meth:`GradientCanaries.sparse_addition` gives
the sampled Dirac canaries' flat coordinates and values, :meth:`GradientCanaries.add_to` (new
tensors) and :func:`add_in_place` (in place, put back bit for bit after the release) add them to
the parameters' tensors at their own offsets, on their device; ``observe`` gathers the canaries'
and witnesses' coordinates where the release lies and copies only those to the host (plus, for
the noise scale, one sum of squares per tensor reduced there: on the CPU a long tensor is read in
chunks through a buffer that stays in the core's cache). Per step the canaries cost a few small
transfers and one read of the release and the clean sum, never a dense vector, a buffer as large
as a parameter tensor or a host copy of the release; past :data:`NOISE_READ` coordinates that read
covers a rotating share of the release's blocks, every coordinate once every
:attr:`GradientCanaries.noise_stride` releases, so the canaries' cost stops growing with the model.

Each included canary then has a gradient of norm ``raw_norm`` (default four clip norms) *before* the
mechanism clips it, and joins each step with the mechanism's real sampling rate: a mechanism whose
clipping or sampling is not what its ledger says moves the canaries' components, and
:meth:`GradientCanaries.conformance` (:mod:`attacks.conformance`) measures it.

What is tested. :meth:`GradientCanaries.audit` tests the *claimed mechanism* by default: the
canaries know the claimed noise multiplier, sampling rate and number of steps (or take a
:class:`~attacks.conformance.MechanismClaim` read from the ledger), and the audit is the union of
two tests at half the error rate each: the conformance test of the mechanism (number of releases,
noise scale along coordinates no included canary touches, influence of an included canary), and
the model-free one-run bound (Steinke et al.) on the canaries' likelihood-ratio scores against the
bare (epsilon, delta) claim. ``analysis="one-run"`` gives the latter alone, at full confidence.

Score of canary k: its direction's component of each observed step, ``x_t = <r_t, u_k> / C``.
``statistic="sum"`` adds them (Steinke et al.); ``"lr"`` adds the per-step log-likelihood ratio
of the claimed step, ``log(1 - q + q exp((x_t - 1/2) / sigma^2))``, the most powerful test of one
canary against the claimed subsampled Gaussian (Neyman-Pearson). Either way the one-run bound is
computed over the canaries alone (their coins are the only randomised inclusion).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from attacks.audit_scores import AuditResult
from attacks.canaries import ONE_SIDED_GUESSES
from attacks.conformance import ConformanceResult, MechanismClaim, ProbeEvidence, conformance_test

if TYPE_CHECKING:  # pragma: no cover
    from attacks.canary_records import CanaryRecords
from attacks.experiment import stream
from attacks.sparse_add import add_at, add_in_place
from attacks.transfers import HostCopy

KINDS = ("dirac", "random")
STATISTICS = ("auto", "sum", "lr")
ANALYSES = ("mechanism", "one-run")
#: an included canary's gradient norm before the mechanism clips it, in clip norms (default)
RAW_NORM = 4.0
#: the noise scale's sum of squares reads a longer CPU tensor in chunks of this many entries
#: (256 KiB of float32: the chunk's differences stay in the core's cache)
SQUARES_CHUNK = 1 << 16
#: the noise scale reads at most about this many coordinates of one release. A longer release is
#: read in a rotating share of its blocks of :data:`NOISE_BLOCK` coordinates: release t reads the
#: blocks b with ``b % stride == t % stride``, so every coordinate is read once every ``stride``
#: releases (:meth:`GradientCanaries.noise_stride`). The share is fixed before any release is seen,
#: so under the claim the statistic stays a chi-square over the coordinates read (fewer degrees
#: of freedom, the same law); what it saves is the read of a long release and its clean sum,
#: which is bound by memory bandwidth (a 1.84M-entry model: 14.7 MB a step, 6-10% of the step).
NOISE_READ = 1 << 18
NOISE_BLOCK = 1 << 16

__all__ = [
    "ANALYSES",
    "GUESS_FRACTIONS",
    "GradientCanaries",
    "MechanismAudit",
    "add_at",
    "add_in_place",
    "attach_to_opacus",
    "claim_optimised_guesses",
    "joined_on",
    "lr_scores",
]

TensorLike = torch.Tensor | Sequence[torch.Tensor]
#: one release as observed: projections, witnesses and the noise share's sum of squares, or the
#: function that gives them once their copy to the host has run
_Observed = (
    tuple[np.ndarray, np.ndarray, float] | Callable[[], tuple[np.ndarray, np.ndarray, float]]
)


def _flat(tensors: TensorLike) -> torch.Tensor:
    if isinstance(tensors, torch.Tensor):
        return tensors.reshape(-1)
    return torch.cat([t.reshape(-1) for t in tensors])


def lr_scores(
    projections: np.ndarray, sample_rates: np.ndarray, noise_multipliers: np.ndarray
) -> np.ndarray:
    """Per-canary log-likelihood ratio of its observed components under the claimed mechanism.

    ``projections`` is (T, m) in clip norms; step ``t`` claims Poisson rate ``q_t`` and noise
    multiplier ``sigma_t``. A step's ratio "canary included" / "canary excluded" is
    ``1 - q + q exp((x - 1/2) / sigma^2)`` (Neyman-Pearson: the most powerful test of one canary).
    """
    x = np.asarray(projections, dtype=np.float64)
    q = np.asarray(sample_rates, dtype=np.float64)[: x.shape[0], None]
    s2 = np.asarray(noise_multipliers, dtype=np.float64)[: x.shape[0], None] ** 2
    z = (x - 0.5) / s2
    full = q >= 1
    out = np.where(full, z, np.logaddexp(np.log1p(-np.minimum(q, 1 - 1e-16)), np.log(q) + z))
    return out.sum(0)


#: fractions of the canaries the claim-optimised guess may take ("in" on the top k)
GUESS_FRACTIONS = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3)


def claim_optimised_guesses(
    claim: MechanismClaim, m: int, *, delta: float, beta: float = 0.05, sims: int = 3, seed: int = 0
) -> list[tuple[float, float]]:
    """Guesses declared before looking, optimised for the claimed mechanism: "in" on the ``k``
    highest likelihood-ratio scores, for two sizes ``k`` (Bonferroni over the two): the one whose
    median one-run bound is largest when the mechanism is exactly as claimed (how close the audit
    comes to the claim), and the one most often above the claimed epsilon when the mechanism adds
    half the claimed noise (the power to see the commonest bug; among equals, one whose ceiling is
    above the claim). Each median is over ``sims`` simulations of the
    claimed mechanism itself (each canary a fair coin, Poisson appearances at the claimed rates,
    Gaussian noise); nothing of the audited run is used, so the guesses are valid for any outcome.
    Where no size gives a positive median bound even with half the noise (too few canaries), the
    one-sided grid :data:`attacks.canaries.ONE_SIDED_GUESSES` is returned.
    """
    return list(
        _optimised_guesses(
            claim.sample_rates.tobytes(),
            claim.noise_multipliers.tobytes(),
            int(m),
            float(delta),
            float(beta),
            int(sims),
            int(seed),
            claim.epsilon(delta),
        )
    )


@functools.lru_cache(maxsize=64)
def _optimised_guesses(
    rates: bytes,
    noises: bytes,
    m: int,
    delta: float,
    beta: float,
    sims: int,
    seed: int,
    claimed: float,
) -> tuple[tuple[float, float], ...]:
    from accountants.tradeoff import CurveFamily
    from attacks.one_run_fdp import fdp_epsilon_lower_bound

    generic = CurveFamily("generic", delta)
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), 0x5EED]))
    ks = sorted({max(1, round(f * m)) for f in GUESS_FRACTIONS if f * m >= 1} | {min(m, 10)})
    q, s = np.frombuffer(rates), np.frombuffer(noises)

    def simulated_bounds(noise: float) -> np.ndarray:
        bounds = np.zeros((sims, len(ks)))
        for i in range(sims):
            inc = rng.random(m) < 0.5
            x = ((rng.random((q.size, m)) < q[:, None]) & inc) + rng.normal(
                0.0, noise, (q.size, m)
            ) * s[:, None]
            right = np.cumsum(inc[np.argsort(-lr_scores(x, q, s), kind="stable")])
            bounds[i] = [
                fdp_epsilon_lower_bound(
                    m, k, int(right[k - 1]), delta=delta, curve=generic, beta=beta / 2
                )
                for k in ks
            ]
        return bounds

    at_claim, half_noise = simulated_bounds(1.0), simulated_bounds(0.5)
    chosen = []
    if np.median(at_claim, 0).max() > 0:  # closest to the claim
        chosen.append(ks[int(np.argmax(np.median(at_claim, 0)))])
    # most often above the claim with half the noise; then one whose ceiling (every guess right)
    # is above the claim, so that a mechanism far worse than half the noise can still be shown;
    # then the larger median bound
    ceiling = np.array(
        [fdp_epsilon_lower_bound(m, k, k, delta=delta, curve=generic, beta=beta / 2) for k in ks]
    )
    power = np.lexsort(
        (np.median(half_noise, 0), ceiling > claimed, (half_noise > claimed).mean(0))
    )[-1]
    if np.median(half_noise, 0)[power] > 0:
        chosen.append(ks[int(power)])
    if not chosen:
        return tuple(ONE_SIDED_GUESSES)
    return tuple((k, 0) for k in sorted(set(chosen)))


class GradientCanaries:
    """``n`` gradient canaries for a DP-SGD run over ``dim`` parameters (see the module docstring).

    Parameters
    ----------
    dim : number of (trainable) parameters, flattened in the order the loop passes them.
    n : number of canaries (``dirac`` needs ``n <= dim``).
    clip_norm : the claimed clipping norm (or sensitivity) ``C``; an auditor-injected canary
        (:meth:`inject`) has L2 norm ``C``.
    sample_rate : the claimed Poisson rate ``q``; :meth:`inject` samples each included canary with it.
    noise_multiplier : the *claimed* sigma (for ``statistic="lr"`` and the conformance test);
        ``None`` allows ``sum`` only.
    steps : the claimed number of steps (releases); ``None``: as many as observed (the release
        count is then not tested).
    kind : ``dirac`` or ``random``. Random directions overlap by about ``1/sqrt(dim)``, so each
        step adds cross-talk of about ``sqrt(q n / dim)`` clip norms to every score: use them with
        ``dim`` much larger than ``n``.
    know_batch : subtract the other records' clipped sum of each step (see the module docstring).
    raw_norm : an included canary's gradient norm before a mechanism clips it (canaries at the
        mechanism, :meth:`vector`); default ``4 * clip_norm``.
    seed : audit seed: coins, directions and the canaries' own sampling use separate streams.
    witness : number of coordinates no canary uses, watched as the noise's own witnesses.
    noise_read : the most coordinates of one release the noise scale reads (Dirac canaries);
        ``None``: :data:`NOISE_READ`. A longer release is read in a rotating share of its blocks
        (:attr:`noise_stride`); ``dim`` reads every release whole.
    """

    def __init__(
        self,
        dim: int,
        n: int,
        *,
        clip_norm: float,
        sample_rate: float,
        noise_multiplier: float | None = None,
        steps: int | None = None,
        kind: str = "dirac",
        know_batch: bool = True,
        raw_norm: float | None = None,
        seed: int = 0,
        witness: int = 256,
        noise_read: int | None = None,
    ):
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}; found {kind!r}")
        if not isinstance(n, (int, np.integer)) or n < 2:
            raise ValueError(f"n (number of canaries) must be an integer >= 2; found {n!r}")
        if kind == "dirac" and n > dim:
            raise ValueError(
                f"n must be <= dim = {dim} for dirac canaries (one coordinate each); found {n}"
            )
        if not clip_norm > 0 or not math.isfinite(clip_norm):
            raise ValueError(f"clip_norm must be a finite number > 0; found {clip_norm}")
        if not 0 < sample_rate <= 1:
            raise ValueError(f"sample_rate must be in (0, 1]; found {sample_rate}")
        if noise_multiplier is not None and noise_multiplier < 0:
            raise ValueError(f"noise_multiplier must be >= 0; found {noise_multiplier}")
        if steps is not None and (not isinstance(steps, (int, np.integer)) or steps < 1):
            raise ValueError(f"steps must be an integer >= 1 or None; found {steps!r}")
        if not isinstance(witness, (int, np.integer)) or witness < 0:
            raise ValueError(f"witness must be an integer >= 0; found {witness!r}")
        if noise_read is not None and (
            not isinstance(noise_read, (int, np.integer)) or noise_read < 1
        ):
            raise ValueError(f"noise_read must be an integer >= 1 or None; found {noise_read!r}")
        raw = 4.0 * clip_norm if raw_norm is None else float(raw_norm)
        if not raw > 0 or not math.isfinite(raw):
            raise ValueError(f"raw_norm must be a finite number > 0; found {raw_norm}")
        self.dim, self.n, self.kind, self.seed = int(dim), int(n), kind, int(seed)
        self.clip_norm, self.sample_rate, self.raw_norm = float(clip_norm), float(sample_rate), raw
        self.noise_multiplier = None if noise_multiplier is None else float(noise_multiplier)
        self.claimed_steps = None if steps is None else int(steps)
        self.know_batch = know_batch
        self.noise_read = None if noise_read is None else int(noise_read)
        self.included = stream(seed, "gradient-canaries/coins").random(self.n) < 0.5
        self.included_ids = np.flatnonzero(self.included)
        rng = stream(seed, "gradient-canaries/directions")
        if kind == "dirac":
            self._coords = torch.as_tensor(
                rng.choice(self.dim, self.n, replace=False), dtype=torch.long
            )
            self._u = None
        else:
            u = torch.as_tensor(rng.standard_normal((self.n, self.dim)), dtype=torch.float32)
            self._u = u / u.norm(dim=1, keepdim=True)
        # the canaries' Poisson sampling is the mechanism's randomness: its own stream, never scored
        self._sampling = torch.Generator().manual_seed(
            int(stream(seed, "gradient-canaries/sampling").integers(2**62))
        )
        self._inc = torch.as_tensor(self.included)
        self._proj: list[np.ndarray] = []
        self._noise_ss: list[float] = []
        self._noise_dof: list[int] = []
        self._clean: torch.Tensor | _CleanShare | None = None  # an injected step's clean sum
        self._pending = False
        self._queued: Callable[[], None] | None = None  # a release's copy still on its way
        self._coins: torch.Tensor | None = None  # this step's sampled canaries, on a device
        self._clean_known = know_batch  # False once a step is observed without the clean sum
        self._record_influence: list[float] = []
        self.influence_tolerance = 1e-6
        self.appearances = np.zeros(self.n, dtype=np.int64)  # diagnostics only; never in a score
        self._witness = self._witness_coordinates(int(witness))
        self._witness_rows: list[np.ndarray] = []
        # set by records(): canary records in the user's loader
        self.records_state: CanaryRecords | None = None
        # canary records: which canaries the user's sampler put in each release (the auditor
        # sees the loader's draws), for the influence per appearance
        self._step_counts = np.zeros(self.n, dtype=np.int64)
        self._appear_rows: list[np.ndarray] = []

    def __getstate__(self) -> dict:
        self._settle()  # a queued copy is the device's: recorded first
        self._count_coins()
        state = dict(self.__dict__)
        state.pop("_layouts", None)  # index tensors cached per device (:class:`_Layout`)
        state.pop("_included_on", None)  # and the included canaries' coordinates
        state.pop("_shares", None)  # and per device (:class:`_NoiseShare`)
        state.pop("_included_layouts", None)  # and their offsets (:class:`_Included`)
        return state

    @classmethod
    def for_parameters(cls, params: Sequence[torch.Tensor], n: int, **kwargs) -> GradientCanaries:
        """Canaries over the trainable tensors ``params`` (their total number of entries)."""
        return cls(sum(int(p.numel()) for p in params if p.requires_grad), n, **kwargs)

    @property
    def steps(self) -> int:
        """Number of releases observed so far (a release still on its way to the host included)."""
        return len(self._proj) + (getattr(self, "_queued", None) is not None)

    @property
    def noise_stride(self) -> int:
        """Releases it takes the noise scale to read every coordinate once: 1 up to
        ``noise_read`` (default :data:`NOISE_READ`) coordinates, each release read whole; past
        it, one block in ``stride``."""
        limit = getattr(self, "noise_read", None) or NOISE_READ  # None: pickled before the knob
        return max(1, -(-self.dim // limit))

    def _noise_share(self) -> _NoiseShare:
        """The blocks the noise scale reads at the release being observed."""
        stride = self.noise_stride
        return _NoiseShare.of(self, stride, self.steps % stride)

    def _witness_coordinates(self, count: int) -> np.ndarray:
        """``count`` coordinates no canary uses (Dirac canaries only): the noise's own witnesses."""
        if self._u is not None or count == 0:
            return np.zeros(0, dtype=np.int64)
        free = self.dim - self.n
        count = min(count, free)
        if count < 3:
            return np.zeros(0, dtype=np.int64)
        rng = stream(self.seed, "gradient-canaries/witness")
        used = self._coords.numpy()
        pick = rng.choice(self.dim, min(self.dim, count + self.n), replace=False)
        pick = pick[~np.isin(pick, used)][:count]
        if pick.size < count:  # few free coordinates: take them all
            pick = np.setdiff1d(np.arange(self.dim), used)[:count]
        return np.sort(pick).astype(np.int64)

    @property
    def reserved_coordinates(self) -> np.ndarray:
        """The flat coordinates canary records keep for themselves: every canary's (included or
        not) and the witnesses'; other records' gradients are zeroed there (:meth:`through`)."""
        return np.union1d(self._coords.numpy(), self._witness)

    def coordinates_of(self, ids: np.ndarray) -> np.ndarray:
        """The Dirac coordinate of each canary in ``ids``."""
        return self._coords.numpy()[np.asarray(ids, dtype=np.int64)]

    def count_appearances(self, ids: np.ndarray) -> None:
        """Canary records ``ids`` (repeats allowed) joined the batch of the current release."""
        if np.size(ids):
            counts = np.bincount(np.asarray(ids, dtype=np.int64), minlength=self.n)
            self.appearances += counts
            self._step_counts += counts

    def record_sources(self, n: int) -> np.ndarray:
        """For each included canary, the record of an ``n``-record data set whose input it copies
        (drawn from the audit's own stream; the input does not matter, its gradient is set)."""
        rng = stream(self.seed, "gradient-canaries/records")
        return rng.integers(0, int(n), self.included_ids.size)

    # ------------------------------------------------------------------ canary records
    def records(self, loader):
        """Put the included canaries, as records, into what ``loader`` samples: returns the loader
        to iterate instead (same sampler kind and parameters, over the data plus the canaries).

        In the loop, pass each batch's per-example gradients through :meth:`through` before
        clipping them, and let every release be observed (:meth:`watch` on the optimizer, or
        :meth:`observe`). A loop that rebuilds its loader (a Flower client, each round) calls this
        again on each new loader over the same records: the canaries and their record carry
        over. See :mod:`attacks.canary_records`.
        """
        from attacks.canary_records import records_loader

        return records_loader(loader, self)

    def through(self, per_example):
        """This batch's per-example gradients with the canary rows set to their Dirac gradients
        (norm :attr:`raw_norm`) and every other row zeroed on the reserved coordinates (in place;
        the same object is returned). Call once per batch of the loader :meth:`records` returned,
        before the loop clips."""
        from attacks.canary_records import replace_rows

        return replace_rows(per_example, self)

    def watch(self, optimizer, *, params=None, batch_size: float = 1.0):
        """Observe each release from ``optimizer``'s gradients just before every step, multiplied
        by ``batch_size`` (the fixed normaliser the loop divides the noisy sum by, e.g. the expected
        batch size; 1 for a loop that steps on the sum). Returns the hook's handle."""
        from attacks.canary_records import watch_optimizer

        if not batch_size > 0:
            raise ValueError(f"batch_size must be > 0; found {batch_size}")
        return watch_optimizer(optimizer, self, params, float(batch_size))

    # ------------------------------------------------------------------ auditor-side injection
    def inject(self, summed: TensorLike, *, in_place: bool = False) -> TensorLike:
        """The clipped sum of this step plus the gradients of the included canaries sampled now.

        The auditor samples the canaries (rate ``sample_rate``) and adds them at norm
        ``clip_norm``, after the loop's clipping: for loops that take no canaries themselves (an
        opacus optimizer, a user's loop). ``summed`` is a flat tensor or a list of tensors (the
        loop's parameter order); the same structure comes back. Call :meth:`observe` with the
        released (noisy) sum before the next ``inject``.

        Dirac canaries are added at their own coordinates (:func:`add_at`: a tensor none of them
        falls in comes back as itself, a touched one as a new tensor; with ``in_place`` the
        tensors of ``summed`` themselves take them, and ``summed`` comes back), and of the clean
        sum the observation's comparison keeps only what it reads (:class:`_CleanShare`: the
        reserved coordinates and the noise scale's share of this release): no dense vector and
        no copy of the whole sum per step. Random directions touch every coordinate: their
        vector is added to every tensor and the clean sum is kept whole.
        """
        if self._pending:
            raise RuntimeError(
                "inject called twice without observe: call observe(released) every step"
            )
        pieces = [t.detach() for t in _pieces(summed)]
        found = sum(int(t.numel()) for t in pieces)
        if found != self.dim:
            raise ValueError(
                f"the summed gradient must have dim = {self.dim} entries; found {found}"
            )
        dirac = self._u is None
        if not self.know_batch:
            self._clean = None
        elif dirac:  # what the observation reads of the clean sum, not the whole of it
            self._clean = _CleanShare.of(self, pieces, self._noise_share())
        else:
            self._clean = _flat(pieces).clone()
        sampled = (torch.rand(self.n, generator=self._sampling) < self.sample_rate) & self._inc
        self.appearances += sampled.numpy()
        self._pending = True
        if not bool(sampled.any()):
            return summed
        if dirac:  # at the sampled canaries' coordinates only, each ``clip_norm`` long
            values = torch.full((int(sampled.sum()),), self.clip_norm, dtype=torch.float64)
            if in_place:
                add_in_place(pieces, self._coords[sampled], values)
                return summed
            added = add_at(_pieces(summed), self._coords[sampled], values)
            return added[0] if isinstance(summed, torch.Tensor) else added
        flat = _flat(pieces)
        add = (
            self._direction_sum(sampled.to(torch.float32)).to(device=flat.device, dtype=flat.dtype)
            * self.clip_norm
        )
        if in_place:
            at = 0
            for t in pieces:
                t.add_(add[at : at + t.numel()].reshape(t.shape))
                at += t.numel()
            return summed
        if isinstance(summed, torch.Tensor):
            return summed + add.reshape(summed.shape)
        out, at = [], 0
        for t in summed:
            k = t.numel()
            out.append(t + add[at : at + k].reshape(t.shape))
            at += k
        return out

    # ------------------------------------------------------------------ canaries at the mechanism
    def _weights(self, weights: torch.Tensor | np.ndarray) -> torch.Tensor:
        """``weights`` (one per included canary) spread over all ``n`` canaries (0 elsewhere);
        counts each canary with a positive weight as appearing in this step."""
        w = torch.as_tensor(np.asarray(weights, dtype=np.float32)).reshape(-1)
        if w.numel() != self.included_ids.size:
            raise ValueError(
                f"weights must have one entry per included canary ({self.included_ids.size}); "
                f"found {w.numel()}"
            )
        full = torch.zeros(self.n)
        full[torch.as_tensor(self.included_ids, dtype=torch.long)] = w
        self.appearances += full.numpy() > 0
        return full

    def vector(self, weights: torch.Tensor | np.ndarray) -> torch.Tensor:
        """``sum_k weights_k u_k`` over the included canaries (``weights`` in :attr:`included_ids`
        order): what the included canaries add to a mechanism's sum once the mechanism has sampled
        them (weight 0) and clipped their raw gradients of norm :attr:`raw_norm`. A flat float32
        tensor of ``dim`` entries on the CPU. A loop's step should use :meth:`add_to` (Dirac
        canaries touch only their own coordinates there); this dense form is kept for callers
        that want the whole vector."""
        return self._direction_sum(self._weights(weights))

    def sparse_addition(
        self, weights: torch.Tensor | np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What :meth:`vector` adds, as ``(flat coordinates, values)``: int64 and float32 CPU
        tensors, one entry per canary with a nonzero weight (Dirac canaries; distinct
        coordinates, in canary order). Random directions touch every coordinate: all ``dim``
        coordinates and :meth:`vector`'s values."""
        if self._u is not None:
            return torch.arange(self.dim), self._direction_sum(self._weights(weights))
        # as :meth:`_weights` then the nonzero entries, on the included canaries alone
        w = np.asarray(weights, dtype=np.float32).reshape(-1)
        if w.size != self.included_ids.size:
            raise ValueError(
                f"weights must have one entry per included canary ({self.included_ids.size}); "
                f"found {w.size}"
            )
        nz = np.flatnonzero(w)
        ids = self.included_ids[nz]
        self.appearances[ids[w[nz] > 0]] += 1
        return torch.from_numpy(self._coords.numpy()[ids]), torch.from_numpy(w[nz])

    def included_coordinates_on(self, device: torch.device) -> torch.Tensor:
        """The included Dirac canaries' flat coordinates (:attr:`included_ids` order) on
        ``device``, kept per device: where a mechanism adds its canaries' weights on the device,
        zero for those it did not sample (:meth:`sampled_on_device`)."""
        if self._u is not None:
            raise ValueError("random-direction canaries touch every coordinate; use add_to")
        cache = self.__dict__.setdefault("_included_on", {})
        if device not in cache:
            cache[device] = torch.as_tensor(self.coordinates_of(self.included_ids)).to(device)
        return cache[device]

    def sampled_on_device(self, sampled: torch.Tensor) -> None:
        """The included canaries a mechanism sampled this step (a bool tensor in
        :attr:`included_ids` order), drawn on a device: counted in :attr:`appearances` once they
        reach the host, with this step's release (:meth:`observe`), so that drawing them there
        costs no wait for the device."""
        if sampled.shape != (self.included_ids.size,):
            raise ValueError(
                f"sampled must have one entry per included canary ({self.included_ids.size}); "
                f"found shape {tuple(sampled.shape)}"
            )
        self._count_coins()  # a step's coins never observed: counted now
        self._coins = sampled

    def _count_coins(self) -> None:
        """Count the sampled canaries of :meth:`sampled_on_device` not yet counted, reading them
        from the device now."""
        coins = getattr(self, "_coins", None)  # absent from canaries pickled before it
        if coins is not None:
            self._coins = None
            self._count_sampled(coins.cpu().numpy())

    def _count_sampled(self, drawn: np.ndarray) -> None:
        """One release's sampled included canaries (``drawn``, nonzero where sampled, in
        :attr:`included_ids` order) in :attr:`appearances`."""
        self.appearances[self.included_ids[drawn != 0]] += 1

    def add_to(
        self, tensors: Sequence[torch.Tensor], weights: torch.Tensor | np.ndarray
    ) -> list[torch.Tensor]:
        """``tensors`` (the flattened parameters' order, ``dim`` entries in all, any device) plus
        what :meth:`vector` gives for ``weights``, computed only where the canaries add
        (:func:`add_at` of :meth:`sparse_addition`): equal to ``t + vector(weights)[slice].to(t)``
        for every tensor ``t``; untouched tensors come back as themselves, none is modified."""
        if sum(int(t.numel()) for t in tensors) != self.dim:
            raise ValueError(
                f"the tensors must have dim = {self.dim} entries; found "
                f"{sum(int(t.numel()) for t in tensors)}"
            )
        return add_at(tensors, *self.sparse_addition(weights))

    def add_in_place(
        self, tensors: Sequence[torch.Tensor], weights: torch.Tensor | np.ndarray
    ) -> Callable[[], None]:
        """Add what :meth:`add_to` adds to ``tensors`` themselves; returns the function that puts
        back, bit for bit, what they held at the canaries' coordinates (for a mechanism that needs
        its clean sum after the release, :meth:`observe`'s ``clean``).

        Dirac canaries on contiguous CPU tensors are added at every included canary's coordinate,
        an unsampled canary's weight 0 with the others (``x + 0`` is ``x``; a negative zero
        becomes a positive one), through index tensors built once per layout of the tensors
        (:class:`_Included`): about three operations per touched tensor a step, none that
        depends on which canaries were sampled. Otherwise as
        :func:`attacks.sparse_add.add_in_place` of :meth:`sparse_addition` (the sampled
        coordinates alone, spread over the tensors anew each step). Each canary with a positive
        weight appears in this step (:attr:`appearances`)."""
        cpu = all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)
        if self._u is not None or not cpu:
            return add_in_place(tensors, *self.sparse_addition(weights))
        w = torch.as_tensor(weights, dtype=torch.float32, device="cpu").reshape(-1)
        if w.numel() != self.included_ids.size:
            raise ValueError(
                f"weights must have one entry per included canary ({self.included_ids.size}); "
                f"found {w.numel()}"
            )
        sizes = tuple(int(t.numel()) for t in tensors)
        if sum(sizes) != self.dim:
            raise ValueError(f"the tensors must have dim = {self.dim} entries; found {sum(sizes)}")
        self.appearances[self.included_ids[w.numpy() > 0]] += 1
        return _Included.of(self, sizes).add_in_place(tensors, w)

    def observe(
        self, released: TensorLike, clean: TensorLike | None = None, *, scale: float = 1.0
    ) -> None:
        """Score this step from the released sum (clean sum + canaries + noise).

        After :meth:`inject` the clean sum is the one it was given. A mechanism that adds the
        canaries itself (:meth:`vector`, :meth:`add_to`) passes ``clean``, the other records' sum
        before the canaries and the noise (ignored with ``know_batch=False``). ``scale``
        multiplies the released tensors first (as ``[t * scale for t in released]`` would).

        Dirac canaries read the release where it lies: only their own and the witnesses'
        coordinates are gathered (on the tensors' device) and copied to the host; the noise scale
        along the other coordinates (without canary records) is one sum of squares reduced on
        the device. Random directions project the whole release (on the host). On a CUDA device
        that copy is queued and read at the next observation (or when the evidence is asked
        for): the step goes on without waiting for the device (:mod:`attacks.transfers`).
        """
        self._settle()
        records = self.records_state is not None
        # the noise's witnesses: where the auditor injects the canaries itself, or canary records
        # reserve them (privkit's own mechanisms, :meth:`vector`, are tested on scale alone)
        witness = self._pending or records
        base: TensorLike | _CleanShare | None
        if self._pending:
            base = self._clean
        elif clean is None or not (self.know_batch or records):
            base = None
        else:
            base = clean
        if base is None and not records:  # canary records keep their coordinates clean
            self._clean_known = False
        share = self._noise_share() if self._u is None else None
        if share is not None:
            got = self._observe_sparse(released, base, scale, share, dense=not records)
        else:  # random directions: inject keeps the clean sum whole
            assert not isinstance(base, _CleanShare)
            got = self._observe_dense(released, base, scale, share)
        self._count_coins()  # a path that did not take them with the release (none left if it did)
        # this release's draws by the user's sampler, taken now: the next batch counts anew
        counts = self._step_counts.copy() if records else None
        if records:
            self._step_counts[:] = 0
        keep_witness = bool(witness and self._witness.size and (records or base is not None))

        def record(x: np.ndarray, wit: np.ndarray, rest: float) -> None:
            self._record(x, wit, rest, share, counts, keep_witness)

        if callable(got):  # a copy on its way to the host: recorded once it is there
            self._queued = lambda: record(*got())
        else:
            record(*got)
        self._clean, self._pending = None, False

    def _record(
        self,
        x: np.ndarray,
        wit: np.ndarray,
        rest: float,
        share: _NoiseShare | None,
        counts: np.ndarray | None,
        keep_witness: bool,
    ) -> None:
        """One release's projections, noise scale, appearances (canary records: ``counts``) and
        witnesses, appended to the evidence."""
        self._proj.append(x)
        if counts is not None:
            exc = x[~self.included]
            ss, dof = float(np.square(exc).sum() + np.square(wit).sum()), int(exc.size + wit.size)
        else:
            ss, dof = self._noise_part(rest, x, share)
        self._noise_ss.append(ss)
        self._noise_dof.append(dof)
        if counts is not None:
            self._appear_rows.append(counts)
        if keep_witness:
            self._witness_rows.append(wit.copy())

    def _settle(self) -> None:
        """Record the release whose copy to the host was queued (:meth:`observe`), if any."""
        queued = getattr(self, "_queued", None)  # absent from canaries pickled before it
        if queued is not None:
            self._queued = None
            queued()

    def _observe_dense(
        self,
        released: TensorLike,
        base: TensorLike | None,
        scale: float,
        share: _NoiseShare | None,
    ) -> tuple[np.ndarray, np.ndarray, float]:
        """Projections, witnesses and (Dirac) the sum of squares of the coordinates the noise
        scale reads (``share``) that no included canary touches, from the whole release on the
        host."""
        r = _flat(released).detach()
        if scale != 1.0:
            r = r * scale
        r = r.to(device="cpu", dtype=torch.float64)
        if r.numel() != self.dim:
            raise ValueError(
                f"the released sum must have dim = {self.dim} entries; found {r.numel()}"
            )
        if base is not None:
            r = r - _flat(base).detach().to(device="cpu", dtype=torch.float64)
        r = r / self.clip_norm
        wit = r[torch.as_tensor(self._witness)].numpy() if self._witness.size else np.zeros(0)
        x = self._project(r)
        if share is None:
            return x, wit, 0.0
        total = sum(float(v.pow(2).sum()) for v in share.read(r))
        # float rounding can leave a tiny negative difference when there is no noise at all
        return x, wit, max(0.0, total - float(np.square(x[share.included]).sum()))

    def _observe_sparse(
        self,
        released: TensorLike,
        base: TensorLike | _CleanShare | None,
        scale: float,
        share: _NoiseShare,
        dense: bool,
    ) -> _Observed:
        """As :meth:`_observe_dense` for Dirac canaries, reading only the reserved coordinates
        (the same floats: gathered, then the same operations) and, with ``dense``, the noise's
        sum of squares reduced on the device, less the included canaries' coordinates: the
        release minus the clean sum squared and summed in the release's dtype by cascade
        summation, one read of each tensor (:meth:`_Layout.squared_difference`; the dense path
        computes it in float64 on the host: the two agree to about 1e-7, relative, far inside
        the statistic's own spread of ``sqrt(2 / dim)``). The statistic needs every coordinate
        of the release and of the clean sum: that read (8 bytes a coordinate in float32) is the
        canaries' one cost that grows with the model, so past :data:`NOISE_READ` coordinates
        each release is read in a share of its blocks (``share``)."""
        rel = [t.detach().reshape(-1) for t in _pieces(released)]
        sizes = tuple(int(t.numel()) for t in rel)
        if sum(sizes) != self.dim:
            raise ValueError(
                f"the released sum must have dim = {self.dim} entries; found {sum(sizes)}"
            )
        ref: list[torch.Tensor] | None = None
        kept = base if isinstance(base, _CleanShare) else None  # an injected step's
        if base is not None and not isinstance(base, _CleanShare):
            ref = [t.detach().reshape(-1) for t in _pieces(base)]
            if tuple(int(t.numel()) for t in ref) != sizes:
                ref = list(_flat(base).detach().split(sizes))
        layout = _Layout.of(self, sizes)
        devices = {t.device for t in rel + (ref or [])} | ({kept.values.device} if kept else set())
        if joined_on(rel[0].device) and len(devices) == 1:
            return self._observe_joined(rel, kept or ref, layout, scale, share, dense)
        if dense and kept is not None:
            sums = [
                layout.squared_difference(rel[j][a:b], r, scale)
                for (j, a, b), r in zip(share.pieces(layout), kept.pieces(share, layout))
            ]
        elif dense:  # the noise scale first: the gathers below then find the release in the cache
            if share.whole:
                sums = [
                    layout.squared_difference(t, None if ref is None else ref[j], scale)
                    for j, t in enumerate(rel)
                ]
            else:  # each piece at most a block, within one tensor
                sums = [
                    layout.squared_difference(
                        rel[j][a:b], None if ref is None else ref[j][a:b], scale
                    )
                    for j, a, b in share.pieces(layout)
                ]
        # the few gathered values, in float64, go on in numpy on the host (the same IEEE
        # operations as torch's, each a fraction of a torch call's fixed cost)
        got = layout.gather(rel, scale).cpu()
        r = got.to(torch.float64).numpy()
        ref_got = None
        if kept is not None:
            ref_got = kept.needed.cpu()
        elif ref is not None:
            ref_got = layout.gather(ref).cpu()
        if ref_got is not None:
            r = r - ref_got.to(torch.float64).numpy()
        units = r / self.clip_norm
        x, wit = units[layout.at_coords], units[layout.at_witness]
        if not dense:
            return x, wit, 0.0
        # the noise scale: one pass per tensor (:meth:`_Layout.squared_difference`), the tensors'
        # sums added in float64, less the included canaries' coordinates, their difference taken
        # in the tensors' dtypes (as v; torch's promotion, bfloat16 included)
        wide = _wide(got.dtype) if ref_got is None else _wide(got.dtype, ref_got.dtype)
        d = got.to(wide) if ref_got is None else got.to(wide) - ref_got.to(wide)
        at = d[share.included_on(d.device, layout)].to(torch.float64).numpy()
        ss = sum(float(sq) for sq in sums) - float(np.dot(at, at))
        return x, wit, max(0.0, ss) / self.clip_norm**2

    def _observe_joined(
        self,
        rel: list[torch.Tensor],
        ref: list[torch.Tensor] | _CleanShare | None,
        layout: _Layout,
        scale: float,
        share: _NoiseShare,
        dense: bool,
    ) -> Callable[[], tuple[np.ndarray, np.ndarray, float]]:
        """:meth:`_observe_sparse` off the CPU, in a handful of launches whatever the number of
        tensors: the release (and the clean sum) joined into one vector (one copy, cheap on a
        device), one gather each, the noise's sum of squares in one reduction, and one transfer
        to the host for all of it. Per tensor these were about five launches each and two host
        synchronisations, the canaries' fixed cost of a small model's step on a GPU. The
        transfer is queued (:class:`attacks.transfers.HostCopy`): what comes back is read by the
        function returned, at the next observation. The gathered floats are the per-tensor
        path's bit for bit; the sum of squares is reduced in one pass rather than per tensor (it
        differs by float rounding)."""
        flat = torch.cat(rel) if len(rel) > 1 else rel[0]
        if scale != 1.0:
            flat = flat * scale
        idx = layout.index_on(flat.device)
        parts = [flat.index_select(0, idx).to(torch.float64)]
        refs: list[torch.Tensor] | None = None  # the clean sum's share, as share.read gives it
        if isinstance(ref, _CleanShare):  # an injected step's: gathered and copied already
            parts.append(ref.needed.to(torch.float64))
            refs = ref.read(share, flat.numel())
        elif ref is not None:
            flat_ref = torch.cat(ref) if len(ref) > 1 else ref[0]
            parts.append(flat_ref.index_select(0, idx).to(torch.float64))
            refs = share.read(flat_ref)
        coins, self._coins = getattr(self, "_coins", None), None
        if coins is not None:  # this step's sampled canaries ride with the release's copy
            parts.append(coins.to(device=flat.device, dtype=torch.float64))
        dtype = _wide(flat.dtype) if refs is None else _wide(flat.dtype, refs[0].dtype)
        if dense:
            if refs is None:
                sums = [a.to(dtype).square().sum() for a in share.read(flat)]
            else:
                sums = [
                    torch.nn.functional.mse_loss(a.to(dtype), b.to(dtype), reduction="sum")
                    for a, b in zip(share.read(flat), refs, strict=True)
                ]
            ss = sums[0] if len(sums) == 1 else torch.stack(sums).sum()
            parts.append(ss.to(torch.float64).reshape(1))
        copy = HostCopy(torch.cat(parts))  # the step's one transfer, queued on a CUDA device
        n = idx.numel()

        def read() -> tuple[np.ndarray, np.ndarray, float]:
            host = copy.result()
            if coins is not None:
                at = (2 if ref is not None else 1) * n
                self._count_sampled(host[at : at + coins.numel()].numpy())
            got = host[:n]
            r = got if ref is None else got - host[n : 2 * n]
            units = (r / self.clip_norm).numpy()
            x, wit = units[layout.at_coords], units[layout.at_witness]
            if not dense:
                return x, wit, 0.0
            # the included canaries' coordinates leave the noise's share, their difference taken
            # in the statistic's dtype (:func:`_wide`) as the per-tensor path takes it
            d = got.to(dtype)
            if ref is not None:
                d = d - host[n : 2 * n].to(dtype)
            inc = share.included_on(d.device, layout)  # host: d came back with the transfer
            noise_ss = float(host[-1]) - float(d[inc].to(torch.float64).square().sum())
            return x, wit, max(0.0, noise_ss) / self.clip_norm**2

        return read

    # ------------------------------------------------------------------ scores and the audit
    def claim(self, steps: int | None = None) -> MechanismClaim:
        """The claimed mechanism: :attr:`claimed_steps` (or ``steps``, or as many as observed)
        releases at the claimed sampling rate and noise multiplier, sensitivity ``clip_norm``."""
        if not self.noise_multiplier:
            raise ValueError(
                f"the conformance test needs the claimed noise_multiplier > 0; found "
                f"{self.noise_multiplier}"
            )
        t = steps or self.claimed_steps or max(self.steps, 1)
        return MechanismClaim.repeated(self.sample_rate, self.noise_multiplier, t, self.clip_norm)

    def evidence(self) -> ProbeEvidence:
        """What the canaries observed (:class:`attacks.conformance.ProbeEvidence`)."""
        self._settle()
        proj = np.stack(self._proj) if self._proj else np.zeros((0, self.n))
        witness = None
        if self._witness_rows and len(self._witness_rows) == len(self._proj):
            witness = np.stack(self._witness_rows)
        return ProbeEvidence(
            proj,
            self.included.copy(),
            np.array(self._noise_ss),
            np.array(self._noise_dof, dtype=np.int64),
            clean_known=self._clean_known,
            record_influence=np.array(self._record_influence) if self._record_influence else None,
            influence_tolerance=self.influence_tolerance,
            witness=witness,
            sampling=self._sampling_record(),
            appearances=np.stack(self._appear_rows) if self._appear_rows else None,
            raw_norm=self.raw_norm / self.clip_norm,
        )

    def _sampling_record(self):
        """What the user's sampler drew (canary records only; None where the auditor sampled)."""
        from attacks.sampling_law import SamplingRecord

        st = self.records_state
        if st is None or not st.batch_sizes:
            return None
        return SamplingRecord(
            st.counts.copy(), np.array(st.batch_sizes, dtype=np.int64), st.repeats, "loader"
        )

    def record_influence(self, norms, tolerance: float = 1e-6) -> None:
        """Record probe records' exact influence on the pre-noise release (L2 norms, same units as
        ``clip_norm``), measured by the mechanism (a deterministic minimiser refitted with and
        without each record); :meth:`conformance` tests them against ``clip_norm`` with this
        relative ``tolerance`` (the solver's guaranteed precision)."""
        v = np.asarray(norms, dtype=np.float64).reshape(-1)
        if not np.all(np.isfinite(v)) or np.any(v < 0):
            raise ValueError(
                f"influence norms must be finite and >= 0; found {v[~(np.isfinite(v) & (v >= 0))][0]}"
            )
        if not tolerance >= 0:
            raise ValueError(f"tolerance must be >= 0; found {tolerance}")
        self._record_influence.extend((v / self.clip_norm).tolist())
        self.influence_tolerance = max(self.influence_tolerance, float(tolerance))

    def scores(self, statistic: str = "auto", claim: MechanismClaim | None = None) -> np.ndarray:
        """Per-canary score (higher = included): ``sum`` of the components or ``lr``, their
        log-likelihood ratio under ``claim`` (default :meth:`claim`; ``auto``: ``lr`` when the
        claimed sigma is known and positive)."""
        if statistic not in STATISTICS:
            raise ValueError(
                f"statistic must be one of {', '.join(STATISTICS)}; found {statistic!r}"
            )
        if statistic == "auto":
            statistic = "lr" if (self.noise_multiplier or claim is not None) else "sum"
        proj = self.evidence().projections
        if statistic == "sum":
            return proj.sum(0)
        if claim is None and not self.noise_multiplier:
            raise ValueError(
                f"statistic 'lr' needs the claimed noise_multiplier > 0; found {self.noise_multiplier}"
            )
        c = claim or self.claim(steps=max(self.steps, self.claimed_steps or 0))
        if c.steps < proj.shape[0]:  # releases beyond the claim: scored as the claim's last
            c = c.over(proj.shape[0])
        return lr_scores(proj, c.sample_rates, c.noise_multipliers)

    def conformance(
        self,
        *,
        claim: MechanismClaim | None = None,
        confidence: float = 0.95,
        delta: float | None = None,
    ) -> ConformanceResult:
        """The conformance test of the mechanism these canaries observed against ``claim``
        (default :meth:`claim`): :func:`attacks.conformance.conformance_test`."""
        if self.steps == 0:
            raise ValueError(
                "no step was observed; run the training loop with these canaries first"
            )
        res = conformance_test(
            self.evidence(), claim or self.claim(), confidence=confidence, delta=delta
        )
        if not self.know_batch:
            res.notes.append(
                "the other records' gradients were not subtracted: the noise test sees "
                "them as extra noise (valid, less powerful)"
            )
        return res

    def audit(
        self,
        *,
        accounted_epsilon: float | None = None,
        delta: float,
        confidence: float = 0.95,
        seed: int | None = None,
        statistic: str = "auto",
        guesses="claim",
        analysis: str = "mechanism",
        claim: MechanismClaim | None = None,
        **kwargs,
    ):
        """Audit the run these canaries observed.

        ``analysis="mechanism"`` (default): the claimed mechanism (``claim``, default :meth:`claim`)
        is tested by the conformance test at ``beta / 2`` and by the one-run bound over the
        canaries' scores at ``beta / 2``; a :class:`MechanismAudit`. ``accounted_epsilon``
        defaults to the claim's epsilon at ``delta``. ``analysis="one-run"``: the one-run bound
        alone (:func:`attacks.audit_scores`, ``inclusion`` random, guesses
        :data:`attacks.canaries.ONE_SIDED_GUESSES`; ``kwargs`` go to it, e.g. ``curve``), an
        :class:`attacks.AuditResult`.

        ``guesses="claim"`` (default where the claimed noise is known): one guess declared in
        advance, optimised for the claimed mechanism (:func:`claim_optimised_guesses`); otherwise
        (or ``guesses`` given as in :func:`attacks.audit_scores`) :data:`attacks.canaries.ONE_SIDED_GUESSES`.
        """
        from accountants.tradeoff import CurveFamily
        from attacks.audit_scores import audit_scores

        if analysis not in ANALYSES:
            raise ValueError(f"analysis must be one of {', '.join(ANALYSES)}; found {analysis!r}")
        if self.steps == 0:
            raise ValueError(
                "no step was observed; run the training loop with these canaries first"
            )
        if not 0 < confidence < 1:
            raise ValueError(f"confidence must be in (0, 1); found {confidence}")
        mechanism = analysis == "mechanism"
        if mechanism:
            claim = claim or self.claim()
            if accounted_epsilon is None:
                accounted_epsilon = claim.epsilon(delta)
        stat = (
            "lr"
            if statistic == "auto" and (self.noise_multiplier or claim is not None)
            else ("sum" if statistic == "auto" else statistic)
        )
        name = f"gradient-canaries-{self.kind}"
        note = (
            f"{self.n} {self.kind} gradient canaries (norm {self.clip_norm:g}, sampled at q = "
            f"{self.sample_rate:g} per step over {self.steps} steps), {int(self.included.sum())} "
            f"included by fair coins; score = {stat} of each step's component along the canary"
            + ("" if self.know_batch else "; the other records' gradients not subtracted")
        )
        half = 1 - (1 - confidence) / 2 if mechanism else confidence
        if isinstance(guesses, str) and guesses == "claim":
            known = claim or (
                self.claim(steps=max(self.steps, self.claimed_steps or 0))
                if self.noise_multiplier
                else None
            )
            guesses = (
                claim_optimised_guesses(known, self.n, delta=delta, beta=1 - half)
                if known is not None and stat == "lr"
                else ONE_SIDED_GUESSES
            )
        # the generic (epsilon, delta) claim, by the f-DP analysis of the one-run experiment
        # (Mahloujifar, Melis & Chaudhuri 2024): valid for every (epsilon, delta)-DP mechanism and a
        # little tighter than Steinke et al.'s bound at delta > 0
        kwargs.setdefault("curve", CurveFamily("generic", delta))
        one_run = audit_scores(
            {name: self.scores(stat, claim)},
            self.included,
            accounted_epsilon=accounted_epsilon,
            delta=delta,
            confidence=half,
            seed=self.seed if seed is None else seed,
            inclusion="random",
            notes={name: note},
            guesses=guesses,
            **kwargs,
        )
        if not mechanism:
            return one_run
        conf = self.conformance(claim=claim, confidence=half, delta=delta)
        return MechanismAudit.of(conf, one_run, confidence)

    def summary(self) -> dict:
        self._settle()  # appearances: the queued release's sampled canaries counted
        self._count_coins()
        inc = self.included
        return {
            "kind": self.kind,
            "canaries": self.n,
            "included": int(inc.sum()),
            "steps": self.steps,
            "clip_norm": self.clip_norm,
            "raw_norm": self.raw_norm,
            "sample_rate": self.sample_rate,
            "claimed_noise_multiplier": self.noise_multiplier,
            "claimed_steps": self.claimed_steps,
            "know_batch": self.know_batch,
            "mean_appearances_included": float(self.appearances[inc].mean()) if inc.any() else 0.0,
            "seed": self.seed,
        }

    # ------------------------------------------------------------------ internals
    def _direction_sum(self, weights: torch.Tensor) -> torch.Tensor:
        if self._u is None:
            out = torch.zeros(self.dim)
            nz = weights != 0
            out[self._coords[nz]] = weights[nz].to(torch.float32)
            return out
        return weights.to(torch.float32) @ self._u

    def _project(self, r: torch.Tensor) -> np.ndarray:
        if self._u is None:
            return r[self._coords].numpy().copy()
        return (self._u.to(torch.float64) @ r).numpy()

    def _noise_part(
        self, rest: float, x: np.ndarray, share: _NoiseShare | None
    ) -> tuple[float, int]:
        """Sum of squares and count of the components no included canary touches: every
        coordinate the noise scale reads (``share``) but the included Dirac canaries' (``rest``,
        their sum of squares); for random directions, the excluded canaries' components
        (cross-talk from included ones only inflates them: conservative)."""
        if share is not None:
            return rest, share.dof
        exc = x[~self.included]
        return float(np.square(exc).sum()), int(exc.size)


def joined_on(device: torch.device) -> bool:
    """Whether the canaries read a release on ``device`` joined into one vector
    (:meth:`GradientCanaries._observe_joined`): off the CPU, where a step is bound by launches and
    a copy of the release is cheap; on the CPU tensor by tensor, with no copy of the release."""
    return device.type != "cpu"


def _wide(*dtypes: torch.dtype) -> torch.dtype:
    """The dtype the noise statistic is computed in: the tensors' promoted dtype, at least
    float32. Summed in bfloat16, the squares' sum (itself a bfloat16) moved by 0.1-0.3% over
    100 to 262,144 coordinates, as much as the statistic's own spread over 262,144 (0.28%)."""
    out = torch.float32
    for d in dtypes:
        out = torch.promote_types(out, d)
    return out


def _pieces(tensors: TensorLike) -> list[torch.Tensor]:
    return [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)


class _Layout:
    """Where the reserved coordinates (every canary's and the witnesses', sorted) lie in a list
    of tensors of the given sizes: which tensors hold any, at which offsets (index tensors cached
    per device), and where each canary's and each witness's value lands in the gathered vector."""

    def __init__(self, canaries: GradientCanaries, sizes: tuple[int, ...]):
        dirac = canaries._u is None
        needed = canaries.reserved_coordinates if dirac else np.zeros(0, dtype=np.int64)
        self.ends = np.cumsum(np.asarray(sizes, dtype=np.int64))
        self.starts = self.ends - np.asarray(sizes, dtype=np.int64)
        which = np.searchsorted(self.ends, needed, side="right")
        self.parts = [(int(j), needed[which == j] - self.starts[j]) for j in np.unique(which)]
        self.needed = needed
        self.at_coords = np.searchsorted(needed, canaries._coords.numpy()) if dirac else needed
        self.at_witness = np.searchsorted(needed, canaries._witness)
        self._index: dict[tuple[int, torch.device], torch.Tensor] = {}
        # per (device, dtype): a chunk's scratch buffer (CPU)
        self._scratch: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def squared_difference(
        self, t: torch.Tensor, ref: torch.Tensor | None, scale: float = 1.0
    ) -> torch.Tensor:
        """``sum((t * scale - ref) ** 2)`` (``ref`` None: ``sum((t * scale) ** 2)``) of a flat
        tensor ``t`` and a flat ``ref``, on ``t``'s device, in the tensors' promoted dtype and
        at least float32 (:func:`_wide`: a half-precision release's squares are not rounded to
        half precision; ``t * scale`` is rounded in ``t``'s dtype, as the release observed).

        A tensor of at most :data:`SQUARES_CHUNK` entries, any tensor off the CPU, and a ``ref``
        of another dtype or device take one fused operation over the whole tensor
        (``mse_loss(t * scale, ref, reduction="sum")``: the release minus the clean sum, squared
        and summed by cascade summation). A longer CPU tensor is read chunk by
        chunk through a scratch buffer kept in the core's cache: each chunk's difference is
        written there and its squares summed by one dot product of the chunk with itself
        (``torch.dot``), and the chunks' sums are added in float64. The
        tensors are read once, no buffer as large as the tensor is written and read back, no
        buffer is allocated per step, and the squares are never written (the dot product
        reads the chunk once more, from the cache). The sum differs from the one-pass float32
        sum by float rounding (about 1e-8 relative, within the one-pass sum's own bound of
        2.5e-7)."""
        n = int(t.numel())
        wide = _wide(t.dtype) if ref is None else _wide(t.dtype, ref.dtype)
        if (
            n <= SQUARES_CHUNK
            or t.device.type != "cpu"
            or (ref is not None and (ref.dtype != t.dtype or ref.device != t.device))
        ):
            v = (t * scale if scale != 1.0 else t).to(wide)
            if ref is None:
                return v.square().sum()
            return torch.nn.functional.mse_loss(
                v, ref.to(device=v.device, dtype=wide), reduction="sum"
            )
        key = (t.device, wide)
        if key not in self._scratch:
            self._scratch[key] = torch.empty(SQUARES_CHUNK, dtype=wide)
        buf = self._scratch[key]
        refs = ref.split(SQUARES_CHUNK) if ref is not None else None
        total = 0.0
        for i, x in enumerate(t.split(SQUARES_CHUNK)):
            d = buf[: x.numel()]
            if x.dtype != wide:  # widened first (scaled in the release's dtype, as observed)
                d.copy_(x * scale if scale != 1.0 else x)
                if refs is not None:
                    d.sub_(refs[i])
            elif scale != 1.0:
                torch.mul(x, scale, out=d)
                if refs is not None:
                    d.sub_(refs[i])
            elif refs is not None:
                torch.sub(x, refs[i], out=d)
            else:  # the chunk itself: nothing to write
                d = x
            total += float(torch.dot(d, d))
        return torch.tensor(total, dtype=torch.float64)

    def index_on(self, device: torch.device) -> torch.Tensor:
        """Every reserved coordinate (sorted) as a flat index on ``device``."""
        key = (-2, device)
        if key not in self._index:
            self._index[key] = torch.as_tensor(self.needed, dtype=torch.long).to(device)
        return self._index[key]

    @classmethod
    def of(cls, canaries: GradientCanaries, sizes: tuple[int, ...]) -> _Layout:
        cache = canaries.__dict__.setdefault("_layouts", {})
        if sizes not in cache:
            if sum(sizes) != canaries.dim:
                raise ValueError(
                    f"the tensors must have dim = {canaries.dim} entries; found {sum(sizes)}"
                )
            cache[sizes] = cls(canaries, sizes)
        return cache[sizes]

    def gather(self, flats: list[torch.Tensor], scale: float = 1.0) -> torch.Tensor:
        """The values at the reserved coordinates (sorted), on the first touched tensor's device."""
        out = []
        for j, local in self.parts:
            t = flats[j]
            key = (j, t.device)
            if key not in self._index:
                self._index[key] = torch.as_tensor(local, dtype=torch.long).to(t.device)
            v = t.index_select(0, self._index[key])
            out.append(v * scale if scale != 1.0 else v)
        dev = out[0].device
        return torch.cat([v.to(dev) for v in out])


class _CleanShare:
    """What the observation of an injected release reads of its clean sum, copied at
    :meth:`GradientCanaries.inject`: the values at the reserved coordinates (sorted, as
    :meth:`_Layout.gather` gives them) and those of the release's noise share (its flat ranges
    one after another, as :meth:`_NoiseShare.pieces` and :meth:`_NoiseShare.read` walk them,
    whatever tensors hold them)."""

    def __init__(self, needed: torch.Tensor, values: torch.Tensor):
        self.needed, self.values = needed, values

    @classmethod
    def of(
        cls, canaries: GradientCanaries, pieces: list[torch.Tensor], share: _NoiseShare
    ) -> _CleanShare:
        flats = [t.reshape(-1) for t in pieces]
        layout = _Layout.of(canaries, tuple(int(t.numel()) for t in flats))
        parts = [flats[j][a:b] for j, a, b in share.pieces(layout)]
        dev = parts[0].device
        # copies (index_select, cat): the loop may change its sum in place before the release
        return cls(layout.gather(flats), torch.cat([p.to(dev) for p in parts]))

    def pieces(self, share: _NoiseShare, layout: _Layout) -> list[torch.Tensor]:
        """The share's values for each of ``share.pieces(layout)``, in order."""
        out, at = [], 0
        for _, a, b in share.pieces(layout):
            out.append(self.values[at : at + b - a])
            at += b - a
        return out

    def read(self, share: _NoiseShare, dim: int) -> list[torch.Tensor]:
        """The share's values shaped as ``share.read`` gives them of a joined vector of ``dim``."""
        if share.whole:
            return [self.values]
        full = dim // share.block
        rows = len(range(share.phase, full, share.stride))
        out = [self.values[: rows * share.block].view(rows, share.block)]
        if self.values.numel() > rows * share.block:
            out.append(self.values[rows * share.block :])
        return out


class _Included:
    """Where the included Dirac canaries' coordinates lie in a list of CPU tensors of the given
    sizes: per touched tensor, the offsets in it (sorted) and where their weights sit in
    ``GradientCanaries.included_ids`` order, as one permutation of the weights and a slice
    per tensor."""

    def __init__(self, canaries: GradientCanaries, sizes: tuple[int, ...]):
        coords = canaries.coordinates_of(canaries.included_ids)
        order = np.argsort(coords, kind="stable")
        ends = np.cumsum(np.asarray(sizes, dtype=np.int64))
        starts = ends - np.asarray(sizes, dtype=np.int64)
        which = np.searchsorted(ends, coords[order], side="right")
        self.order = torch.from_numpy(order.astype(np.int64))
        self.parts: list[tuple[int, torch.Tensor, int, int]] = []  # tensor, offsets, slice
        for j in np.unique(which):
            at = np.flatnonzero(which == j)
            local = coords[order[at]] - starts[j]
            self.parts.append((int(j), torch.from_numpy(local), int(at[0]), int(at[-1]) + 1))

    @classmethod
    def of(cls, canaries: GradientCanaries, sizes: tuple[int, ...]) -> _Included:
        cache = canaries.__dict__.setdefault("_included_layouts", {})
        if sizes not in cache:
            cache[sizes] = cls(canaries, sizes)
        return cache[sizes]

    def add_in_place(self, tensors: Sequence[torch.Tensor], w: torch.Tensor) -> Callable[[], None]:
        """Add ``w`` (float32, one per included canary) at the canaries' offsets in place (the
        same float additions as ``index_put_(..., accumulate=True)`` of the sampled ones); the
        function returned copies the saved values back."""
        v = w.index_select(0, self.order)
        saved = []
        for j, local, a, b in self.parts:
            flat = tensors[j].detach().view(-1)
            saved.append((flat, local, flat.index_select(0, local)))
            flat.index_add_(0, local, v[a:b].to(flat.dtype))

        def restore() -> None:
            for flat, local, old in saved:
                flat.index_copy_(0, local, old)

        return restore


class _NoiseShare:
    """The coordinates the noise scale reads at one release (:data:`NOISE_READ`): every one
    (``whole``), or the blocks ``b`` of :data:`NOISE_BLOCK` coordinates with
    ``b % stride == phase``; and which included Dirac canaries lie among them (their components
    carry the canaries, not noise alone, and leave the sum)."""

    def __init__(self, canaries: GradientCanaries, stride: int, phase: int):
        dim, size = canaries.dim, NOISE_BLOCK
        self.whole, self.stride, self.phase, self.block = stride == 1, stride, phase, size
        if self.whole:
            self.ranges = [(0, dim)]
            read = np.ones(canaries.n, dtype=bool)
        else:
            starts = range(phase * size, dim, stride * size)
            self.ranges = [(a, min(a + size, dim)) for a in starts]
            read = (canaries._coords.numpy() // size) % stride == phase
        self.included = canaries.included & read
        #: degrees of freedom: coordinates read, less the included canaries' among them
        self.dof = sum(b - a for a, b in self.ranges) - int(self.included.sum())
        self._pieces: dict[tuple[int, ...], list[tuple[int, int, int]]] = {}
        self._index: dict[torch.device, torch.Tensor] = {}

    @classmethod
    def of(cls, canaries: GradientCanaries, stride: int, phase: int) -> _NoiseShare:
        cache = canaries.__dict__.setdefault("_shares", {})
        if (stride, phase) not in cache:
            cache[stride, phase] = cls(canaries, stride, phase)
        return cache[stride, phase]

    def pieces(self, layout: _Layout) -> list[tuple[int, int, int]]:
        """The ranges as ``(tensor, start, end)`` within the tensors of ``layout``."""
        key = tuple(int(e) for e in layout.ends)
        if key not in self._pieces:
            out = []
            for a, b in self.ranges:
                for j in np.flatnonzero((layout.starts < b) & (layout.ends > a)):
                    lo, hi = max(a, int(layout.starts[j])), min(b, int(layout.ends[j]))
                    out.append((int(j), lo - int(layout.starts[j]), hi - int(layout.starts[j])))
            self._pieces[key] = out
        return self._pieces[key]

    def read(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """The coordinates read of a joined release ``flat``, as views: the whole blocks (one
        strided view, no index and no copy) and the last, partial block where it is read."""
        if self.whole:
            return [flat]
        full = flat.numel() // self.block
        out = [flat[: full * self.block].view(full, self.block)[self.phase :: self.stride]]
        if flat.numel() > full * self.block and full % self.stride == self.phase:
            out.append(flat[full * self.block :])
        return out

    def included_on(self, device: torch.device, layout: _Layout) -> torch.Tensor:
        """Where the included canaries read here lie in ``layout``'s gathered vector."""
        if device not in self._index:
            at = layout.at_coords[self.included]
            self._index[device] = torch.as_tensor(at, dtype=torch.long).to(device)
        return self._index[device]


@dataclass
class MechanismAudit:
    """A white-box audit of a claimed mechanism: conformance test and one-run bound, each at
    half the error rate, so the verdict holds at ``confidence`` for both together.

    ``verdict`` is ``violation`` when either rejects the claim, else ``consistent`` (the
    conformance test can always see a mechanism that departs from its claim). ``epsilon_lower_bound``,
    ``epsilon_ceiling`` and ``detectable_epsilon`` are the one-run bound's (model-free);
    ``measured_epsilon`` is the conformance test's (see :mod:`attacks.conformance`).
    """

    verdict: str
    message: str
    confidence: float
    conformance: ConformanceResult
    one_run: AuditResult

    @classmethod
    def of(cls, conformance: ConformanceResult, one_run, confidence: float) -> MechanismAudit:
        bad = [
            n
            for n, v in (
                ("conformance test", conformance.verdict),
                ("one-run bound", one_run.verdict),
            )
            if v == "violation"
        ]
        verdict = "violation" if bad else "consistent"
        head = (f"VIOLATION ({' and '.join(bad)})" if bad else "no violation") + (
            f" of the claimed mechanism at {100 * confidence:.4g}% confidence (two tests at half the error "
            "rate each)"
        )
        return cls(
            verdict,
            f"{head}. Conformance: {conformance.message} One-run: {one_run.message}",
            float(confidence),
            conformance,
            one_run,
        )

    @property
    def epsilon_lower_bound(self) -> float:
        return self.one_run.epsilon_lower_bound

    @property
    def epsilon_ceiling(self) -> float:
        return self.one_run.epsilon_ceiling

    @property
    def detectable_epsilon(self) -> float:
        return self.one_run.detectable_epsilon

    @property
    def accounted_epsilon(self) -> float | None:
        return self.one_run.accounted_epsilon

    @property
    def measured_epsilon(self) -> float | None:
        return self.conformance.measured_epsilon

    def to_dict(self) -> dict:
        one = self.one_run.to_dict()
        return {
            **one,
            "status": self.verdict,
            "message": self.message,
            "analysis": "mechanism",
            "confidence": self.confidence,
            "one_run": {"status": self.one_run.verdict, "confidence": self.one_run.confidence},
            "conformance": self.conformance.to_dict(),
        }


def attach_to_opacus(optimizer, canaries: GradientCanaries, data_loader=None, *, module=None):
    """Insert ``canaries`` into every step of an opacus ``DPOptimizer``.

    With ``data_loader`` (the loader opacus trains from, as ``make_private`` returned it), the
    canaries are *records*: they join what that loader samples (its Poisson or shuffled batches,
    any sampler the user passed) and go through opacus' per-sample clipping (hooks; ghost
    clipping with ``module=``, the module ``make_private`` returned), and each release is observed
    after opacus' noise and normalisation (:mod:`attacks.canary_records`). The call returns the
    loader to iterate instead of ``data_loader``.

    Without ``data_loader`` (returns the optimizer): opacus computes ``p.summed_grad`` (clipped
    sum) in ``clip_and_accumulate`` and ``p.grad = p.summed_grad + noise`` in ``add_noise``,
    before ``scale_grad`` divides by the expected batch size. The wrapper adds the auditor's
    canaries (:meth:`GradientCanaries.inject`, sampled by the auditor at the claimed rate) to
    ``summed_grad`` just before the noise and observes ``p.grad`` just after it, so the accountant
    hook opacus attaches to ``step`` is untouched. A step opacus skips (no per-sample gradients)
    inserts and observes nothing. This tests the noise only: opacus' sampler and clipping are
    not exercised.
    """
    params = list(optimizer.params)
    if sum(p.numel() for p in params) != canaries.dim:
        raise ValueError(
            f"canaries are over dim = {canaries.dim} entries but the optimizer has "
            f"{sum(p.numel() for p in params)}"
        )
    if abs(getattr(optimizer, "max_grad_norm", canaries.clip_norm) - canaries.clip_norm) > 1e-12:
        raise ValueError(
            f"canaries' clip_norm {canaries.clip_norm} differs from the optimizer's "
            f"max_grad_norm {optimizer.max_grad_norm}"
        )
    if data_loader is not None:
        from attacks.canary_records import attach_records_to_opacus

        return attach_records_to_opacus(optimizer, canaries, data_loader, module)
    original = optimizer.add_noise

    def add_noise() -> None:
        # in place: opacus marks summed_grad as processed
        canaries.inject([p.summed_grad for p in params], in_place=True)
        original()
        canaries.observe([p.grad for p in params])

    optimizer.add_noise = add_noise
    return optimizer
