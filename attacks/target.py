"""Black-box access to a released model plus the ground truth the auditor keeps aside."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from attacks import signals
from privkit.models import select_device


@torch.no_grad()
def model_logits(model: torch.nn.Module, x: np.ndarray, *, device: str | torch.device = "auto",
                 batch_size: int = 1024) -> np.ndarray:
    """Logits of ``model`` on ``x`` in eval mode, batched, on ``cuda`` when present (``device="auto"``)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1; found {batch_size}")
    dev = device if isinstance(device, torch.device) else select_device(device)
    was_training = model.training
    model.to(dev).eval()
    out = []
    for s in range(0, len(x), batch_size):
        xb = torch.as_tensor(np.asarray(x[s:s + batch_size]), dtype=torch.float32, device=dev)
        out.append(model(xb).float().cpu())
    model.train(was_training)
    return torch.cat(out).numpy().astype(np.float64) if out else np.zeros((0, 0))


@dataclass
class Target:
    """A released model queried only through its outputs, and the audit points' true membership.

    Attributes
    ----------
    model : the released torch model (only ever queried for logits).
    x, y : the audit points (inputs and true labels).
    membership : True where the point was in the model's training data (kept aside by the
        auditor; attacks never see it).
    name : label for reports.
    indices : optional indices of the audit points in the private dataset.
    """

    model: torch.nn.Module
    x: np.ndarray
    y: np.ndarray
    membership: np.ndarray
    name: str = "target"
    indices: np.ndarray | None = None
    device: str = "auto"
    batch_size: int = 1024
    _logits: np.ndarray | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.y = np.asarray(self.y, dtype=np.int64)
        self.membership = np.asarray(self.membership, dtype=bool)
        if not len(self.x) == len(self.y) == len(self.membership):
            raise ValueError(f"x, y and membership must have equal lengths; found {len(self.x)}, "
                             f"{len(self.y)}, {len(self.membership)}")

    def query(self, x: np.ndarray) -> np.ndarray:
        """Logits of the released model on arbitrary points (black-box access)."""
        return model_logits(self.model, x, device=self.device, batch_size=self.batch_size)

    def logits(self) -> np.ndarray:
        """Logits on the audit points (cached)."""
        if self._logits is None:
            self._logits = self.query(self.x)
        return self._logits

    def probabilities(self) -> np.ndarray:
        return signals.probabilities(self.logits())

    @classmethod
    def from_arrays(cls, model: torch.nn.Module, x_members: np.ndarray, y_members: np.ndarray,
                    x_nonmembers: np.ndarray, y_nonmembers: np.ndarray, *, name: str = "target",
                    device: str = "auto") -> Target:
        """A user's own torch model with its member and non-member data."""
        x = np.concatenate([np.asarray(x_members), np.asarray(x_nonmembers)])
        y = np.concatenate([np.asarray(y_members), np.asarray(y_nonmembers)])
        m = np.r_[np.ones(len(x_members), bool), np.zeros(len(x_nonmembers), bool)]
        return cls(model=model, x=x, y=y, membership=m, name=name, device=device)

    @classmethod
    def from_result(cls, result, federation, audit_idx: np.ndarray, *, name: str = "target",
                    device: str = "auto") -> Target:
        """A privkit :class:`~privkit.trainers.TrainResult`'s released model on the audit points
        ``audit_idx`` (indices into ``federation.private``); membership = in some client's data."""
        idx = np.asarray(audit_idx, dtype=np.int64)
        member = np.isin(idx, federation.members)
        return cls(model=result.model, x=federation.private.x[idx], y=federation.private.y[idx],
                   membership=member, name=name, indices=idx, device=device)
