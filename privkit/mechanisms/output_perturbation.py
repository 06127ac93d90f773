"""Gaussian output perturbation: the one DP primitive every privkit head release (and FedMD-LDP's
noised predictions) goes through.

``released = clean + N(0, sigma^2 I)``, where ``clean`` is a deterministic function of the data
(the exact minimiser of a strongly convex ERM: FedAUX's scoring heads, FedAUXfdp's class heads and
the DP-head baselines, :func:`privkit.trainers.heads.release_head`) whose L2 sensitivity is
``sensitivity``; the ledger records ``GaussianDpEvent(sigma / sensitivity)``. The noise comes from
the caller's generator (the AES stream in release mode, the seeded one in reproducible mode:
:func:`privkit.seeding.noise_rng`), drawn as one ``rng.normal`` call, so a release outside an
audit is bit-identical to the plain ``clean + rng.normal(0, sigma, clean.shape)``.  In release mode
(``rng`` the AES stream) the release lies on the data-independent grid of
:mod:`privkit.mechanisms.grid_noise`, its noise covering the grid's rounding, so the floating-point attack on
``clean + sigma * z`` does not apply and the ledger's ``GaussianDpEvent(sigma / sensitivity)``
still accounts for it.

Audits act here, where the mechanism runs:

* **mutations** (:mod:`privkit.mechanisms.mutations`): the noise's standard deviation is multiplied by
  ``active().noise_factor`` (``noise x1/2``, ``noise x1/N``); ``clipping off`` switches the
  sensitivity bound off, which for output perturbation is the feature normalisation the bound
  assumes (:func:`privkit.trainers.heads.head_features`) and, here, the canaries' bounded weight;
* **probes** (:func:`privkit.mechanisms.probes.canaries_for`, label = the release's ledger label): each
  included canary is a record whose influence on ``clean`` the mechanism bounds by
  ``sensitivity``. Its raw influence is ``canaries.raw_norm`` (four sensitivities); the bound
  brings it down to ``sensitivity`` (up to ``raw_norm`` with the bound switched off, as DP-SGD's
  clipping does for its canaries), it is added before the noise, and the canaries observe the
  noisy release with ``clean`` subtracted. One release, unsampled (``sample_rate=1``), noise
  multiplier ``sigma / sensitivity``: exactly the ledger's Gaussian event. The canaries stand for
  the worst-case record; a real record's exact influence is measured by ``record_influence``
  (probe records refitted into the minimiser), which the conformance test's ``sensitivity``
  part compares with ``sensitivity``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from privkit.errors import PrivkitError
from privkit.mechanisms import mutations
from privkit.mechanisms.gaussian import gaussian_release

#: ``record_influence(canaries) -> (norms, tolerance)``: probe records' exact influence on the
#: pre-noise release (L2 norms, same units as the sensitivity) and the relative precision of the
#: measurement (:meth:`attacks.whitebox.GradientCanaries.record_influence`)
RecordInfluence = Callable[[Any], tuple[np.ndarray, float]]

__all__ = ["RecordInfluence", "gaussian_output_perturbation"]


def gaussian_output_perturbation(
    clean: np.ndarray,
    *,
    sigma: float,
    sensitivity: float,
    rng: np.random.Generator,
    client: int | None = None,
    label: str | None = None,
    record_influence: RecordInfluence | None = None,
    rows: bool = False,
    dtype: type | None = None,
    receipts: list | None = None,
) -> np.ndarray:
    """Release ``clean + N(0, sigma^2 I)`` (see the module docstring).

    Parameters
    ----------
    clean : numpy.ndarray
        The pre-noise value (any shape), a deterministic function of the data with L2 sensitivity
        ``sensitivity``.
    sigma : float
        The noise standard deviation the ledger accounts for (``> 0``).
    sensitivity : float
        The claimed L2 sensitivity (the ledger's noise multiplier is ``sigma / sensitivity``).
    rng : numpy.random.Generator
        The DP noise stream (:func:`privkit.seeding.noise_rng`).
    client, label : int, str, optional
        Whose release this is and its ledger label: an audit's probes are taken for this pair
        (``client=None``: a release outside any client's ledger, never probed).
    record_influence : callable, optional
        Under probes only: measures probe records' exact influence on ``clean`` (see
        :data:`RecordInfluence`); its result goes to the canaries' sensitivity test.
    rows : bool
        ``clean`` is (R, d): R releases of d numbers each, one Gaussian event per row (FedMD-LDP's
        shared prediction vectors, each of sensitivity ``sensitivity``); probes see each row.
    dtype : numpy dtype, optional
        Add noise and value in this type (the noise is cast first), e.g. float32 for a release
        made in float32; default float64.
    receipts : list, optional
        Where the release's receipt (:class:`privkit.mechanisms.Receipt`, the Gaussian event of
        each row or of the whole value) is appended, for the caller's ledger.

    Returns
    -------
    numpy.ndarray
        The released value, ``clean``'s shape, float64.
    """
    if not sigma > 0 or not sensitivity > 0:
        raise PrivkitError(
            f"sigma and sensitivity must be > 0; found sigma={sigma}, sensitivity={sensitivity}"
        )
    mutation = mutations.active()
    kind = np.float64 if dtype is None else dtype
    clean = np.asarray(clean, dtype=kind)
    if rows and clean.ndim != 2:
        raise PrivkitError(
            f"rows=True needs a 2-D value (one release per row); found shape {clean.shape}"
        )

    def add_noise(value: np.ndarray) -> np.ndarray:  # the release primitive, one draw of it all
        released, receipt = gaussian_release(
            value,
            std=sigma,
            sensitivity=sensitivity,
            source=rng,
            dim=clean.shape[-1] if rows else clean.size,
            releases=clean.shape[0] if rows else 1,
        )
        if receipts is not None:
            receipts.append(receipt)
        return released

    canaries = None
    if client is not None:
        from privkit.mechanisms.probes import canaries_for

        canaries = canaries_for(
            client,
            label or "output-perturbation",
            dim=clean.shape[-1] if rows else clean.size,
            clip_norm=sensitivity,
            sample_rate=1.0,
            noise_multiplier=sigma / sensitivity,
        )
    if canaries is None:
        return add_noise(clean)
    import torch

    # an included canary's raw influence, bounded by the sensitivity unless the bound is off
    raw = float(canaries.raw_norm)
    weight = min(raw, sensitivity) if mutation.clipping else raw
    add = canaries.vector(np.full(canaries.included_ids.size, weight)).numpy().astype(kind)
    released = add_noise(clean + (add if rows else add.reshape(clean.shape)))
    for got, base in zip(released, clean) if rows else [(released, clean)]:
        canaries.observe(torch.as_tensor(got.ravel()), clean=torch.as_tensor(base.ravel()))
    if record_influence is not None:
        norms, tolerance = record_influence(canaries)
        canaries.record_influence(norms, tolerance=tolerance)
    return released
