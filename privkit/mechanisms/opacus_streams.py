"""opacus drawing its DP randomness from a :class:`~privkit.mechanisms.dp_random.DpRandom`.

opacus spends secret randomness in two places and takes a ``torch.Generator`` for both (its own
secure mode needs torchcsprng, which no longer builds for current torch): the Poisson batches of
``DPDataLoader`` (``UniformWithReplacementSampler``: per step, each record joins independently with
probability ``sample_rate``) and the Gaussian noise of ``DPOptimizer.add_noise``.  In release mode
privkit draws both from its AES stream instead:

* :func:`secret_poisson_loader`: the same batches (``len(dp_loader)`` steps per epoch, one
  Bernoulli(``sample_rate``) inclusion per record and step) over the same dataset with opacus's own
  collate function (which turns an empty batch into zero-length tensors);
* :func:`use_noise_source` (both modes): the optimizer's ``add_noise`` replaced on the instance
  by the same update, ``p.grad = p.summed_grad + N(0, (noise_multiplier * max_grad_norm)^2)``,
  drawn by privkit's release primitive (in release mode the noisy sums on the data-independent
  grid of :mod:`privkit.mechanisms.grid_noise`), which hands back each step's receipt.  A wrapper installed
  afterwards (``attacks.whitebox.attach_to_opacus``) wraps this one, as it wraps opacus's.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader

from privkit.mechanisms.dp_random import DpRandom

__all__ = ["secret_poisson_loader", "use_noise_source"]


class _PoissonBatches:
    """Batch sampler: ``steps`` batches, each record in each independently with rate ``q``."""

    def __init__(self, n: int, rate: float, steps: int, source: DpRandom):
        self.n, self.rate, self.steps, self.source = n, rate, steps, source

    def __len__(self) -> int:
        return self.steps

    def __iter__(self):
        for _ in range(self.steps):
            yield torch.nonzero(self.source.mask(self.n, rate=self.rate)).flatten().tolist()


def secret_poisson_loader(dp_loader, source: DpRandom) -> DataLoader:
    """``dp_loader``'s (an opacus ``DPDataLoader``) batches, drawn from ``source``."""
    sampler = _PoissonBatches(len(dp_loader.dataset), dp_loader.sample_rate, len(dp_loader), source)
    return DataLoader(dp_loader.dataset, batch_sampler=sampler, collate_fn=dp_loader.collate_fn)


def use_noise_source(dp_opt, source: DpRandom) -> list:
    """Make the opacus ``DPOptimizer`` ``dp_opt`` draw its Gaussian noise through privkit's release
    primitive (:func:`privkit.mechanisms.gaussian_release`) from ``source``: the noisy sum of every
    parameter's ``summed_grad``, one release of L2 sensitivity ``max_grad_norm``, in the
    optimizer's parameter order. Returns the list the steps' receipts are appended to.

    Seeded, the noise is ``std * randn`` per parameter, which equals opacus' own
    ``torch.normal(0, std)`` bit for bit on tensors of 16 entries or more (torch's vectorised
    normal kernel) and within one unit in the last place on smaller ones. An audit's mutation
    scales the noise drawn (in the primitive), never the receipt.
    """
    from opacus.optimizers.optimizer import _check_processed_flag, _mark_as_processed

    from privkit.mechanisms.gaussian import gaussian_release

    receipts: list = []

    def add_noise() -> None:  # opacus's DPOptimizer.add_noise with privkit's release
        params = list(dp_opt.params)
        for p in params:
            _check_processed_flag(p.summed_grad)
        noisy, receipt = gaussian_release(
            [p.summed_grad for p in params],
            std=dp_opt.noise_multiplier * dp_opt.max_grad_norm,
            sensitivity=dp_opt.max_grad_norm,
            source=source,
            sample_rate=getattr(dp_opt, "privkit_sample_rate", None),
        )
        receipts.append(receipt)
        for p, g in zip(params, noisy):
            p.grad = g.view_as(p)
            _mark_as_processed(p.summed_grad)

    dp_opt.add_noise = add_noise
    return receipts
