"""The size limit of privkit's PLD grids and the error that says a grid would pass it (a module of
its own so that the certified composition, which :mod:`accountants.fast` calls, can name them
without importing it back)."""

from __future__ import annotations

__all__ = ["MAX_PLD_POINTS", "PldGridError"]

# Largest PLD grid built (points of one pmf, before or after a composition): about 1 GB at the peak of
# a self-composition and a few seconds.  dp-accounting's PLD of a Gaussian spans mu**2 + 20 mu nats
# (mu = 1/sigma of the composed Gaussian), so on the default 1e-4 grid this admits mu up to about 20
# (epsilon near 300 at delta 1e-5), on a 1e-2 grid about 280; past it the callers fall back to RDP or
# leave the bracket out, saying why.
MAX_PLD_POINTS = 2**23


class PldGridError(ValueError):
    """A PLD would need more than :data:`MAX_PLD_POINTS` grid points (message names the count)."""
