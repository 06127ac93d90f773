"""Trainers: one module per method, each registering itself in :data:`REGISTRY`.

Use :func:`train` (``privkit.trainers.train("fedavg", federation, {...}, seed=0)``) or the CLI
``privkit train METHOD``.
"""

from privkit.trainers.base import (REGISTRY, TrainerConfig, TrainerSpec, TrainResult, get_trainer,
                                   make_config, register_trainer, train)

__all__ = ["REGISTRY", "TrainResult", "TrainerConfig", "TrainerSpec", "get_trainer", "make_config",
           "register_trainer", "train"]

# Method modules register themselves on import (one line each, below).
from privkit.trainers import fedmd as _fedmd  # noqa: F401,E402
from privkit.trainers import flip as _flip  # noqa: F401,E402
from privkit.trainers import fedkadp as _fedkadp  # noqa: F401,E402
from privkit.trainers import fedkd as _fedkd  # noqa: F401,E402
from privkit.trainers import dpsgd as _dpsgd  # noqa: F401,E402
from privkit.trainers import centralized as _centralized  # noqa: F401,E402
from privkit.trainers import fedavg as _fedavg  # noqa: F401,E402
from privkit.trainers import feddf as _feddf  # noqa: F401,E402
from privkit.trainers import fedaux as _fedaux  # noqa: F401,E402
from privkit.trainers import fedauxfdp as _fedauxfdp  # noqa: F401,E402
