"""privkit's DP mechanisms: the Gaussian release every single-model mechanism draws its noise
through, and the receipt it returns (:mod:`privkit.mechanisms.gaussian`)."""

from privkit.mechanisms.gaussian import NormalRows, Receipt, compose_receipts, gaussian_release

__all__ = ["NormalRows", "Receipt", "compose_receipts", "gaussian_release"]
