"""JSON encoding of the numpy values that results carry (one ``default=`` hook for every writer)."""

from __future__ import annotations

from typing import Any

import numpy as np


def json_default(obj: Any) -> Any:
    """``json.dumps(..., default=json_default)``: numpy scalars and arrays as Python values,
    anything else (paths, enums) as its string form."""
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    return str(obj)
