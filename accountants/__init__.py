"""privkit accountants: mechanisms, sensitivities, privacy events, composition, calibration, ledger,
trade-off curves.

Everything public is importable from here.  This package never imports torch (the optional opacus
PRV cross-check imports opacus lazily, only when asked for).

Names are resolved lazily (PEP 562): ``import accountants`` costs milliseconds, and dp-accounting
and scipy (about 1.2 s together) load with the first submodule that needs them.  A command line
can therefore validate its input with :mod:`accountants._validate` and answer a bad value at once.
"""

from __future__ import annotations

import importlib
from typing import Any

from accountants import _logging

# submodule -> the public names it exports
_EXPORTS: dict[str, tuple[str, ...]] = {
    "bracket": ("Bracket", "optimistic_epsilon", "pld_bracket"),
    "calibration": ("Calibration", "calibrate_noise_multiplier"),
    "composition": ("advanced_composition", "basic_composition"),
    "dpsgd": (
        "PLD_VDI",
        "DpsgdResult",
        "dpsgd_accounting",
        "dpsgd_epsilon",
        "dpsgd_event",
        "neighbouring_relation",
        "new_accountant",
        "prv_bracket",
    ),
    "events": (
        "EpsilonDeltaEvent",
        "NfdpSubsampleEvent",
        "NonPrivateEvent",
        "event_from_dict",
        "event_to_dict",
    ),
    "filter": ("RenyiFilter", "plan_order"),
    "gaussian": (
        "GaussianCalibration",
        "analytic_gaussian_delta",
        "analytic_gaussian_sigma",
        "calibrate_gaussian",
        "classic_gaussian_sigma",
        "gaussian_epsilon",
    ),
    "ledger": (
        "ACCOUNTANTS",
        "NOT_FOR_RELEASE",
        "SCHEMA_VERSION",
        "Accounting",
        "Ledger",
        "LedgerEntry",
        "UnsupportedEventError",
    ),
    "nfdp": (
        "nfdp_delta",
        "nfdp_epsilon_delta",
        "nfdp_profile",
        "nfdp_warnings",
        "record_exposure_warning",
    ),
    "choices": ("SAMPLERS",),
    "samplers": ("SamplerAccounting", "account_loader", "describe_loader", "sampler_accounting"),
    "sensitivity": (
        "logreg_binary_sensitivity",
        "logreg_multinomial_sensitivity",
        "logreg_multinomial_sensitivity_cfree",
        "project_to_unit_ball",
    ),
    "tradeoff": (
        "CurveFamily",
        "GaussianCurve",
        "GenericCurve",
        "ProfileCurve",
        "TradeoffCurve",
        "curve_family",
        "curve_from_callable",
        "gaussian_curve",
        "gaussian_mu",
        "gdp_curve",
        "generic_curve",
        "ledger_curve",
        "pld_curve",
    ),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = list(_MODULE_OF)  # built from _EXPORTS, the one list of names


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if (
        module is None
    ):  # a submodule reached as an attribute (accountants.ledger) loads on first use
        try:
            return importlib.import_module(f"accountants.{name}")
        except ModuleNotFoundError as exc:
            if (
                exc.name != f"accountants.{name}"
            ):  # the submodule exists; one of its imports is missing
                raise
            raise AttributeError(f"module 'accountants' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(f"accountants.{module}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


_logging.install()
