"""Names of the choices the accountants accept, importable without dp-accounting or scipy so that a
command line can reject a bad choice before loading them."""

from __future__ import annotations

SAMPLERS = ("poisson", "shuffle", "random-allocation")
"""How DP-SGD batches are drawn: Poisson subsampling, shuffled fixed-size batches, random allocation."""
