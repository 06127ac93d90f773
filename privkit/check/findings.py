"""What a configuration check finds: one :class:`Finding` per mismatch, gathered in a :class:`TrainingCheck`."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["Finding", "TrainingCheck", "changes"]

# relative slack when comparing two epsilons computed by the same accountant
_SLACK = 1e-9


def changes(claimed: float | None, holds: float | None) -> bool:
    """Whether the epsilon that holds may exceed the claimed one (unknown on either side counts as yes).

    Parameters
    ----------
    claimed : float or None
        The epsilon the accounting claims.
    holds : float or None
        A sound upper bound on the epsilon of what runs; None where none is known.

    Returns
    -------
    bool
    """
    if claimed is None or holds is None:
        return True
    return holds > claimed * (1 + _SLACK)


def _eps(value: float | None) -> str:
    return "?" if value is None else f"{value:.4g}"


@dataclass(frozen=True)
class Finding:
    """One mismatch between what will run and what will be accounted.

    Attributes
    ----------
    kind : str
        What is mismatched: ``"shuffle"``, ``"fixed_order"``, ``"with_replacement"``,
        ``"weighted"`` (without replacement), ``"unknown_sampler"``, ``"sample_rate"``, ``"distributed"``, ``"noise_multiplier"``,
        ``"secure_mode"``, ``"batchnorm"``, ``"running_statistics"``, or a Flower kind (``"flower_"`` followed by one of
        :data:`privkit.flower.checks.WARNING_KINDS`, or ``"flower_strategy"``).
    message : str
        One line naming the object, the parameters found and the epsilons.
    changes_epsilon : bool
        True when the claimed epsilon may not hold for what runs (the CLI then exits 1).
    claimed_epsilon : float or None
        The epsilon the accounting claims (None where it claims none).
    epsilon_upper : float or None
        A sound upper bound on the epsilon of what runs, None where privkit cannot compute one.
    epsilon_lower : float or None
        A certified lower bound on that epsilon (an attack's), where one is known.
    """

    kind: str
    message: str
    changes_epsilon: bool
    claimed_epsilon: float | None = None
    epsilon_upper: float | None = None
    epsilon_lower: float | None = None

    def __post_init__(self) -> None:
        if "\n" in self.message:
            raise ValueError(f"message must be one line; found {self.message!r}")

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}"


@dataclass(frozen=True)
class TrainingCheck:
    """Every finding of :func:`privkit.check.check_training`, with the objects it read.

    Attributes
    ----------
    findings : tuple of Finding
        One per mismatch, in the order the objects were given.
    delta : float
        The delta every epsilon is stated at (LocalDpMod findings: the mod's own delta).
    checked : tuple of str
        One entry per object read: its name and type.
    """

    findings: tuple[Finding, ...]
    delta: float
    checked: tuple[str, ...]

    @property
    def changes_epsilon(self) -> bool:
        """Whether some finding means the claimed epsilon may not hold."""
        return any(f.changes_epsilon for f in self.findings)

    @property
    def exit_code(self) -> int:
        """1 when a finding changes the epsilon, else 0 (``privkit check``'s exit status)."""
        return int(self.changes_epsilon)

    def verdict(self) -> str:
        """One line: how many findings, how many of them change the epsilon."""
        if not self.findings:
            return f"verdict: no finding in {len(self.checked)} object(s): what runs is what is accounted"
        n, bad = len(self.findings), sum(f.changes_epsilon for f in self.findings)
        head = f"verdict: {n} finding(s) in {len(self.checked)} object(s), "
        if bad:
            verb = "changes" if bad == 1 else "change"
            return head + f"{bad} {verb} the epsilon: the claimed epsilon does not hold"
        return head + "none changes the epsilon"

    def lines(self) -> list[str]:
        """One line per finding, then the verdict."""
        return [str(f) for f in self.findings] + [self.verdict()]

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (infinite epsilons stay floats; the CLI writes them strictly)."""
        return {
            "delta": self.delta,
            "checked": list(self.checked),
            "findings": [asdict(f) for f in self.findings],
            "changes_epsilon": self.changes_epsilon,
            "exit_code": self.exit_code,
            "verdict": self.verdict(),
        }


def bracket(upper: float | None, lower: float | None) -> str:
    """``"epsilon <= U (>= L certified)"`` for a message, ``"no sound epsilon"`` without ``U``."""
    if upper is None:
        return "no sound epsilon"
    if math.isinf(upper):
        return "epsilon inf"
    text = f"epsilon <= {_eps(upper)}"
    return text if lower is None else f"{text} (>= {_eps(lower)} certified)"
