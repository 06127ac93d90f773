"""privkit accountants: mechanisms, sensitivities, privacy events, composition, calibration, ledger,
trade-off curves.

Everything public is importable from here.  This package never imports torch (the optional opacus
PRV cross-check imports opacus lazily, only when asked for).
"""

from accountants import _logging
from accountants.bracket import Bracket, optimistic_epsilon, pld_bracket
from accountants.calibration import Calibration, calibrate_noise_multiplier
from accountants.composition import advanced_composition, basic_composition
from accountants.dpsgd import (
    PLD_VDI,
    DpsgdResult,
    dpsgd_accounting,
    dpsgd_epsilon,
    dpsgd_event,
    neighbouring_relation,
    new_accountant,
    prv_bracket,
)
from accountants.events import (
    EpsilonDeltaEvent,
    NfdpSubsampleEvent,
    NonPrivateEvent,
    event_from_dict,
    event_to_dict,
)
from accountants.filter import RenyiFilter, plan_order
from accountants.gaussian import (
    GaussianCalibration,
    analytic_gaussian_delta,
    analytic_gaussian_sigma,
    calibrate_gaussian,
    classic_gaussian_sigma,
    gaussian_epsilon,
)
from accountants.ledger import (
    ACCOUNTANTS,
    NOT_FOR_RELEASE,
    SCHEMA_VERSION,
    Accounting,
    Ledger,
    LedgerEntry,
    UnsupportedEventError,
)
from accountants.nfdp import (
    nfdp_delta,
    nfdp_epsilon_delta,
    nfdp_profile,
    nfdp_warnings,
    record_exposure_warning,
)
from accountants.samplers import (
    SAMPLERS,
    SamplerAccounting,
    account_loader,
    describe_loader,
    sampler_accounting,
)
from accountants.sensitivity import (
    logreg_binary_sensitivity,
    logreg_multinomial_sensitivity,
    logreg_multinomial_sensitivity_cfree,
    project_to_unit_ball,
)
from accountants.tradeoff import (
    CurveFamily,
    GaussianCurve,
    GenericCurve,
    ProfileCurve,
    TradeoffCurve,
    curve_family,
    curve_from_callable,
    gaussian_curve,
    gaussian_mu,
    gdp_curve,
    generic_curve,
    ledger_curve,
    pld_curve,
)

__all__ = [
    "ACCOUNTANTS",
    "NOT_FOR_RELEASE",
    "PLD_VDI",
    "RenyiFilter",
    "SAMPLERS",
    "SamplerAccounting",
    "SCHEMA_VERSION",
    "Accounting",
    "Calibration",
    "DpsgdResult",
    "EpsilonDeltaEvent",
    "GaussianCalibration",
    "Ledger",
    "LedgerEntry",
    "NfdpSubsampleEvent",
    "NonPrivateEvent",
    "UnsupportedEventError",
    "account_loader",
    "advanced_composition",
    "analytic_gaussian_delta",
    "analytic_gaussian_sigma",
    "basic_composition",
    "calibrate_gaussian",
    "calibrate_noise_multiplier",
    "classic_gaussian_sigma",
    "describe_loader",
    "dpsgd_accounting",
    "dpsgd_epsilon",
    "dpsgd_event",
    "event_from_dict",
    "event_to_dict",
    "gaussian_epsilon",
    "logreg_binary_sensitivity",
    "logreg_multinomial_sensitivity",
    "logreg_multinomial_sensitivity_cfree",
    "neighbouring_relation",
    "new_accountant",
    "nfdp_delta",
    "nfdp_epsilon_delta",
    "nfdp_profile",
    "nfdp_warnings",
    "plan_order",
    "prv_bracket",
    "Bracket",
    "optimistic_epsilon",
    "pld_bracket",
    "project_to_unit_ball",
    "record_exposure_warning",
    "sampler_accounting",
    # trade-off curves (accountants.tradeoff)
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
]

_logging.install()
