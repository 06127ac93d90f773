"""privkit: privacy accounting and auditing of private (federated) machine learning.

Packages in this distribution:

* ``privkit``      core: config, data, models, trainers, run orchestration, CLI
* ``accountants``  mechanisms, sensitivities, privacy events, composition, per-client ledger
* ``attacks``      membership and attribute inference audits, empirical epsilon
* ``reports``      report schema, plots and renderers
"""

from importlib.metadata import PackageNotFoundError, version

from privkit.errors import PrivkitError

try:  # the distribution is privkit-ml ("privkit" on the package index is another project)
    __version__ = version("privkit-ml")
except PackageNotFoundError:
    try:  # an install made before the rename
        __version__ = version("privkit")
    except PackageNotFoundError:  # running from a source tree without installation
        __version__ = "0.0.0+local"

__all__ = ["PrivkitError", "__version__"]
