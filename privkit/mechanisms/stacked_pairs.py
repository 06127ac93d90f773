"""FedKD+DP's mentor-mentee pairs as stacked tensors, with per-example joint clipping.

A pair (:class:`privkit.trainers.fedkd.MentorMentee`) is clipped as one model: mentor, mentee and
``W_h`` together. The single run uses this class with one model (``MentorMentee.stacked_form``),
the batched audit path (:mod:`privkit.batched.many_dpfed`) with one model per (run, client).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from privkit.mechanisms.stacked import StackedModels

if TYPE_CHECKING:  # pragma: no cover
    from privkit.trainers.fedkd import MentorMentee


class StackedPairs(StackedModels):
    """M :class:`~privkit.trainers.fedkd.MentorMentee` pairs as stacked tensors (parameter names
    ``mentor.*``, ``mentee.*``, ``w_h.weight``); output ``[t logits | s logits | h_t | W_h h_s]``
    per example, as the module's. Per-example joint clipping from each layer's inputs and output
    gradients (:meth:`StackedModels.clipped_sums`): the loss's gradients with respect to ``h_t``
    and ``W_h h_s`` join the backward passes of the two towers at their heads' inputs."""

    def __init__(self, pair: MentorMentee, n_models: int):
        self.mentor, self.mentee = (
            StackedModels(pair.mentor, n_models),
            StackedModels(pair.mentee, n_models),
        )
        self.m, self.norm_offset = n_models, 0.0
        self.parametrised = (
            [f"mentor.{n}" for n in self.mentor.parametrised]
            + [f"mentee.{n}" for n in self.mentee.parametrised]
            + ["w_h"]
        )

    def chunk_size(self, x: torch.Tensor) -> int:
        return min(self.mentor.chunk_size(x), self.mentee.chunk_size(x))

    @property
    def linear_on_input(self) -> bool:
        """Two towers read the input: no input norms are taken from the caller."""
        return False

    def _chunk_pieces(self, params, buffers, x, losses_of, record) -> dict[str, tuple]:
        def part(d: dict, prefix: str) -> dict:
            return {k[len(prefix) :]: v for k, v in d.items() if k.startswith(prefix)}

        pt, ps = part(params, "mentor."), part(params, "mentee.")
        w_h = params["w_h.weight"]
        tape_t: list = []
        tape_s: list = []
        with torch.no_grad():
            t = self.mentor._run(pt, part(buffers, "mentor."), x, tape_t)
            s = self.mentee._run(ps, part(buffers, "mentee."), x, tape_s)
            h_t, h_s = tape_t[-1].tensor, tape_s[-1].tensor  # the heads' inputs
            out = torch.cat([t, s, h_t, torch.bmm(h_s, w_h.transpose(1, 2))], dim=-1)
        out.requires_grad_(True)
        with torch.enable_grad():
            (dout,) = torch.autograd.grad(losses_of(out).sum(), [out])
        c, d = t.shape[-1], h_t.shape[-1]
        dt, ds, dh_t, dproj = (
            dout[..., :c],
            dout[..., c : 2 * c],
            dout[..., 2 * c : 2 * c + d],
            dout[..., 2 * c + d :],
        )
        per = {
            f"mentor.{n}": v
            for n, v in self.mentor._backward(
                tape_t, dt, pt, [n[7:] for n in record if n.startswith("mentor.")], {"head": dh_t}
            ).items()
        }
        per.update(
            {
                f"mentee.{n}": v
                for n, v in self.mentee._backward(
                    tape_s,
                    ds,
                    ps,
                    [n[7:] for n in record if n.startswith("mentee.")],
                    {"head": torch.bmm(dproj, w_h)},
                ).items()
            }
        )
        if "w_h" in record:
            per["w_h"] = ("linear_nobias", h_s, dproj)
        return per


__all__ = ["StackedPairs"]
