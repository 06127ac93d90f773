"""Copies between the host and a CUDA device that leave the device's queue running.

torch's ``tensor.to(device)`` between host memory and a CUDA device waits for the stream: it
queues the copy, then blocks the host until every kernel queued before it has run
(``non_blocking=False``). The host cannot queue the step's next kernels meanwhile, and the
device idles while it does. A DP-SGD step with white-box canaries made three such copies (the
sampled canaries' coordinates and values to the device, their observed coordinates back), each a
full stop of the step; a step without canaries made none. The copies here go through
page-locked host memory, which the device copies in stream order without stopping the host:
:func:`to_device` for a host tensor going to the device, :class:`HostCopy` for a device tensor
coming back, read only once the event recorded behind its copy has passed (a wait for that copy
alone, not for what was queued after it). Elsewhere (the CPU, another accelerator) both are
plain ``.to``.
"""

from __future__ import annotations

import torch

__all__ = ["HostCopy", "to_device"]


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t.to(device)`` (``t`` on the host), queued behind the device's work on a CUDA device:
    staged in page-locked memory, which torch keeps from reuse until the copy has run."""
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class HostCopy:
    """A copy of ``t`` on the host, queued where ``t`` is on a CUDA device: :meth:`result` waits for
    the copy itself (an event recorded behind it) and returns the host tensor. The copy is taken
    when this is made: later changes to ``t`` do not reach it."""

    def __init__(self, t: torch.Tensor):
        self._event: torch.cuda.Event | None = None
        if t.device.type != "cuda":
            self._host = t.to("cpu", copy=True)
            return
        self._host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        self._host.copy_(t, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record(torch.cuda.current_stream(t.device))  # the stream the copy went on

    def result(self) -> torch.Tensor:
        """The host tensor, once its copy has run."""
        if self._event is not None:
            if not self._event.query():  # long done, as a rule: then no wait at all
                self._event.synchronize()
            self._event = None
        return self._host
