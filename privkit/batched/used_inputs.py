"""An audit's reference clients train their first layer over the inputs their records use.

A privkit MLP's first layer reads the raw inputs. An input that is 0 in every record of a client
gets a zero gradient from every example, so in a local round of plain SGD (no momentum, no weight
decay) the weights it feeds move by the release noise alone: after T steps by
``-lr / B * (z_1 + ... + z_T)``, with ``z_t`` the step's normals of standard deviation
``sigma * C``. That sum has the law of one normal of T times the variance, and those weights
touch nothing else during the round (their input is 0 in every batch). So a reference client (an
audit's own model, seeded noise, never released: docs/auditing-methods.md) trains its first
layer over the inputs its records use, and its other first-layer weights take that one normal at
the end of the round (:class:`Narrowed`): the model it hands back has the law it would have had
with every step's full draw. The demo's MNIST clients leave 29-37% of the 784 pixels at 0 in
every record, so their reference clients draw about a third fewer normals a step, and their
first layer's products shrink as much.

The steps' releases and receipts are unchanged but for their width: each step still releases
the client's whole clipped gradient over the inputs it trains, with noise of the claimed
scale (an audit's mutation included), and the receipts, which record the noise multiplier, the
sensitivity and the sampling rate, are the ones of the full release. The audited target run and
any client with canaries take every step's full release (:func:`narrowable` leaves them out).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn

from privkit.batched.exact_mlp import _inputs_in_use, mlp_layers
from privkit.batched.many import LocalDp
from privkit.mechanisms import mutations
from privkit.mechanisms.stacked import UnsupportedModelError


def narrowable(job: LocalDp) -> bool:
    """Whether a job may train over its used inputs: a reference model (seeded noise) without
    canaries (a probed client's canaries read its whole release)."""
    return job.fast and job.noise_gen.seeded_torch and job.canaries is None


def first_layers(template: nn.Module, optimizer: str) -> list[str]:
    """The weights (parameter names) of the layers that read the raw inputs, when ``template`` is
    a privkit MLP or a FedKD+DP pair of MLPs trained with plain SGD (the only case where the
    unused inputs' weights move by the noise alone); else none."""
    from privkit.trainers.fedkd import MentorMentee

    if optimizer != "sgd":
        return []
    towers = (
        [("mentor.", template.mentor), ("mentee.", template.mentee)]
        if isinstance(template, MentorMentee)
        else [("", template)]
    )
    try:
        return [f"{prefix}{mlp_layers(tower)[0]}.weight" for prefix, tower in towers]
    except UnsupportedModelError:
        return []


@dataclass
class Narrowed:
    """The jobs' first-layer weights over each job's used inputs (padded to the longest) and the
    jobs' records over the same inputs; :meth:`widen` puts the trained weights back in place and
    gives the other weights their noise."""

    weights: list[str]  #: the names of the weights that read the inputs
    order: torch.Tensor  #: (models, in): per model its kept inputs first, then the others
    kept: int  #: inputs kept per model
    params: dict[str, torch.Tensor]  #: the stacked parameters, those weights narrowed
    jobs: list[LocalDp]  #: the jobs, their records narrowed (the same receipts lists)

    @classmethod
    def of(
        cls, weights: list[str], params: dict[str, torch.Tensor], jobs: Sequence[LocalDp]
    ) -> Narrowed | None:
        """The narrowing of ``jobs`` (every one :func:`narrowable`) whose stacked parameters are
        ``params``; None where there is no trained weight to narrow or some job uses every input."""
        if not weights or any(name not in params for name in weights):  # none, or frozen
            return None
        flat = [j.x.reshape(len(j.x), -1) for j in jobs]
        need = torch.stack([_inputs_in_use(x) for x in flat])
        kept = int(need.sum(1).max())
        if kept == need.shape[1]:
            return None
        device = params[weights[0]].device
        # a stable sort: the used inputs first, then the unused ones, each in input order
        order = torch.argsort((~need).to(torch.uint8), dim=1, stable=True).to(device)
        cols = order[:, :kept]
        narrow = dict(params)
        for name in weights:
            w = params[name]  # (models, out, in)
            narrow[name] = torch.gather(w, 2, cols[:, None, :].expand(-1, w.shape[1], -1))
        narrowed = [
            replace(j, x=x.index_select(1, c.to(x.device)), receipts=j.receipts)
            for j, x, c in zip(jobs, flat, cols)
        ]
        return cls(list(weights), order, kept, narrow, narrowed)

    def widen(
        self, full: dict[str, torch.Tensor], steps: int, lr: float
    ) -> dict[str, torch.Tensor]:
        """``full`` (the stacked parameters before the round) with the trained narrowed
        parameters in place, and each model's other weights of the inputs moved by the sum of
        ``steps`` steps' noise there, divided by the expected batch size and times ``lr``."""
        out = {k: v for k, v in self.params.items() if k not in self.weights}
        cols, rest = self.order[:, : self.kept], self.order[:, self.kept :]
        outs = [full[name].shape[1] for name in self.weights]
        noise = self._summed_noise(sum(outs), rest.shape[1], steps, full[self.weights[0]])
        scale = torch.tensor(
            [lr / j.step.expected_batch_size for j in self.jobs], device=noise.device
        )
        noise.mul_(scale.to(noise.dtype).view(-1, 1, 1))
        for name, part in zip(self.weights, noise.split(outs, dim=1)):
            n = full[name].shape[1]
            w = full[name].scatter(2, cols[:, None, :].expand(-1, n, -1), self.params[name])
            out[name] = w.scatter_add_(2, rest[:, None, :].expand(-1, n, -1), -part)
        return out

    def _summed_noise(self, outs: int, unused: int, steps: int, like: torch.Tensor) -> torch.Tensor:
        """Per model ``(outs, unused)`` normals, the sum of ``steps`` steps' noise at its step's
        scale (``sqrt(steps)`` times it), an audit's mutation applied as the release primitive
        applies it, in one draw from the first job's noise stream. Not a release of its own: these
        are the unused coordinates' share of the steps' releases, whose receipts the jobs hold."""
        factor = mutations.active().noise_factor  # the primitive's (1.0 outside audits)
        scale = torch.tensor(
            [
                math.sqrt(steps) * j.step.noise_multiplier * j.step.clip_norm * factor
                for j in self.jobs
            ],
            dtype=like.dtype,
        )
        noise = self.jobs[0].noise_gen.randn((len(self.jobs), outs, unused), dtype=like.dtype)
        return noise.mul_(scale.to(noise.device).view(-1, 1, 1)).to(like.device)


def train_over_used_inputs(
    weights: list[str],
    params: dict[str, torch.Tensor],
    jobs: list[LocalDp],
    train: Callable[[dict[str, torch.Tensor], list[LocalDp]], None],
    *,
    steps: int,
    lr: float,
) -> dict[str, torch.Tensor]:
    """``train(params, jobs)`` (a round's ``steps`` local SGD steps at ``lr``, in place on the
    stacked parameters) over the jobs' used inputs where ``weights`` narrow (:class:`Narrowed`),
    else as given; the stacked parameters after the round."""
    narrowed = Narrowed.of(weights, params, jobs)
    if narrowed is None:
        train(params, jobs)
        return params
    train(narrowed.params, narrowed.jobs)
    return narrowed.widen(params, steps, lr)


__all__ = ["Narrowed", "first_layers", "narrowable", "train_over_used_inputs"]
