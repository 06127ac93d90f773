"""How numbers are written in a report's tables (HTML, Markdown and the view models behind them)."""

from __future__ import annotations

import math

from reports.schema import EpsilonBracket


def fmt_eps(x: float | None) -> str:
    """Epsilon for display: 3 significant digits, 'inf' for no guarantee, an em dash if unknown."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    if math.isinf(x):
        return "inf"
    if x == 0:
        return "0"
    if abs(x) < 0.01 or abs(x) >= 1000:
        return f"{x:.3g}"
    if abs(x) < 10:
        return f"{x:.3f}".rstrip("0").rstrip(".")
    return f"{x:.1f}"


def fmt_bracket(bracket: EpsilonBracket | None, reason: str | None = None) -> str:
    """A certified ``[lower, upper]`` with enough digits to show its width; why there is none."""
    if bracket is not None:
        return f"[{bracket.lower:.6g}, {bracket.upper:.6g}]"
    return "— (upper bound only)" if reason == "not-tight" else "—"


def fmt_num(x: float | None, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return f"{x:.{digits}f}"


def fmt_pct(x: float | None) -> str:
    if x is None or (isinstance(x, float) and (math.isnan(x) or math.isinf(x))):
        return "—"
    return f"{100 * x:.1f}%"


def sort_value(x: float | None) -> str:
    """A numeric key for the table sorter (missing values sort last)."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return ""
    if math.isinf(x):
        return "1e308" if x > 0 else "-1e308"
    return repr(float(x))
