"""Boundary checks shared by the accountants (plain ``ValueError``: this package cannot import privkit)."""

from __future__ import annotations

import math
import numbers

MAX_STEPS = 10**300  # the accountants multiply by a count of steps in float64 (up to 1.8e308)


def check_open_unit(value: float, name: str) -> float:
    """Require ``value`` in the open interval (0, 1)."""
    value = check_real(value, name)
    if not 0.0 < value < 1.0:
        raise ValueError(f"{name} must be in (0, 1); found {value!r}")
    return value


def check_real(value: object, name: str) -> float:
    """Require a real, non-NaN number (bool is rejected)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a real number; found {value!r}")
    value = float(value)
    if math.isnan(value):
        raise ValueError(f"{name} must be a number; found nan")
    return value


def check_positive(value: float, name: str, *, allow_inf: bool = False) -> float:
    """Require ``value > 0`` (finite unless ``allow_inf``)."""
    value = check_real(value, name)
    if not value > 0.0 or (math.isinf(value) and not allow_inf):
        raise ValueError(f"{name} must be a positive finite number; found {value!r}")
    return value


def check_nonnegative(value: float, name: str, *, allow_inf: bool = False) -> float:
    """Require ``value >= 0`` (finite unless ``allow_inf``)."""
    value = check_real(value, name)
    if value < 0.0 or (math.isinf(value) and not allow_inf):
        raise ValueError(f"{name} must be a non-negative number; found {value!r}")
    return value


def check_int(value: object, name: str, *, minimum: int = 1, maximum: int | None = None) -> int:
    """Require an integer ``>= minimum`` (and ``<= maximum`` when given; floats with an integral
    value are accepted)."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer >= {minimum}; found {value!r}")
    if isinstance(value, numbers.Integral):
        ivalue = int(value)
    elif isinstance(value, numbers.Real) and float(value).is_integer():
        ivalue = int(float(value))
    else:
        raise ValueError(f"{name} must be an integer >= {minimum}; found {value!r}")
    if ivalue < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}; found {value!r}")
    if maximum is not None and ivalue > maximum:
        raise ValueError(f"{name} must be an integer <= {maximum:.3g}; found {_short(value)}")
    return ivalue


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}...({len(text)} digits)"


def check_choice(value: str, name: str, choices: tuple[str, ...]) -> str:
    """Require ``value`` to be one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; found {value!r}")
    return value
