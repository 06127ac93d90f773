"""One progress display for every long loop of privkit: the audit layer's (rich; silent when disabled)."""

from attacks.progress import progress_bar

__all__ = ["progress_bar"]
