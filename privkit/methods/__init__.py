"""What each training method is, without its training code: config models and registrations.

Validating a config (``privkit train --set``, ``privkit run CONFIG.toml``, ``privkit train --list``)
must answer in well under a second, and the training code imports torch, opacus and friends (seconds).
So every method is split in two modules of the same name:

* ``privkit/methods/<module>.py`` (this package, torch-free): the method's pydantic config class(es)
  and one :func:`declare` call per method: name, config class, summary, paper, ``formal_dp``, the
  ``quick`` overrides, and the dotted path of its training function, e.g.
  ``"privkit.trainers.dpsgd:train_dpsgd"``;
* ``privkit/trainers/<module>.py``: the training function; it re-exports the config classes so
  ``from privkit.trainers.dpsgd import DpsgdConfig`` keeps working.

:data:`REGISTRY` maps each name to its :class:`TrainerSpec`; ``spec.fn`` imports the training
module (and torch) only when it is read, i.e. when training runs. Importing this package declares
every shipped method (one line each, below); :func:`register_trainer` registers any other function
(tests, plug-ins) directly. :func:`get_trainer` and :func:`make_config` live here, beside the
declarations they read (:mod:`~privkit.methods.registry` only stores them).
"""

from privkit.errors import PrivkitError
from privkit.methods.base import TrainerConfig
from privkit.methods.registry import REGISTRY, TrainerSpec, declare, register_trainer

__all__ = [
    "REGISTRY",
    "TrainerConfig",
    "TrainerSpec",
    "declare",
    "flower_methods",
    "get_trainer",
    "make_config",
    "register_trainer",
]

from privkit.methods import centralized as _centralized  # noqa: F401
from privkit.methods import dp_fedavg as _dp_fedavg  # noqa: F401
from privkit.methods import dp_fedavg_client as _dp_fedavg_client  # noqa: F401
from privkit.methods import dpsgd as _dpsgd  # noqa: F401
from privkit.methods import fedaux as _fedaux  # noqa: F401
from privkit.methods import fedauxfdp as _fedauxfdp  # noqa: F401
from privkit.methods import fedavg as _fedavg  # noqa: F401
from privkit.methods import feddf as _feddf  # noqa: F401
from privkit.methods import fedkadp as _fedkadp  # noqa: F401
from privkit.methods import fedkd as _fedkd  # noqa: F401
from privkit.methods import fedmd as _fedmd  # noqa: F401
from privkit.methods import flip as _flip  # noqa: F401


def get_trainer(name: str) -> TrainerSpec:
    """The registration of method ``name`` (every shipped method is declared above)."""
    if name not in REGISTRY:
        raise PrivkitError(f"method must be one of {', '.join(sorted(REGISTRY))}; found {name!r}")
    return REGISTRY[name]


def make_config(method: str, data: dict | TrainerConfig | None = None) -> TrainerConfig:
    """Validate ``data`` against ``method``'s config model (defaults for missing keys)."""
    spec = get_trainer(method)
    if isinstance(data, TrainerConfig):
        return data
    return spec.config_cls.model_validate(data or {})


def flower_methods() -> tuple[str, ...]:
    """The methods whose server and client steps run on Flower: those whose registry entry names a
    port (:attr:`TrainerSpec.flower`), sorted by name."""
    return tuple(sorted(name for name, spec in REGISTRY.items() if spec.flower is not None))
