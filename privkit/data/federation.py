"""A federation: one private dataset split among clients, public/auxiliary data, test set, shadow pool.

Everything is an index set into a dataset, so the same split is reused by every method and by the
audits, and a split saved to JSON reloads to the identical indices.

Layout of the private dataset's indices (disjoint):

* ``test``         held-out test set (the dataset's official test split when it has one)
* ``shadow_pool``  data the auditor owns, disjoint from everything the target saw; shadow models
                   and attack non-members come from here
* ``clients[i]``   client i's private training data (Dirichlet / IID / shards)
* ``public``       only when no separate public dataset is named: public data carved out of the
                   private dataset (then it lives in the private dataset's index space)

Public/auxiliary data (``public_dataset``, e.g. ``digits28`` for MNIST clients) is split into
``distill`` (80 %) and ``negative`` (20 %) parts for the methods that need both (FedAUX).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
from pydantic import Field, field_validator, model_validator

from privkit.config import StrictModel
from privkit.data.datasets import ArrayDataset, load_dataset
from privkit.data.partition import (
    dirichlet_partition,
    iid_partition,
    shard_partition,
    top_class_shares,
)
from privkit.errors import PrivkitError
from privkit.seeding import make_rng

SCHEMA_VERSION = 1

Fraction = Annotated[float, Field(gt=0, lt=1)]
CARVED_PUBLIC_SIZE = 0.1  # share of `dataset` used as public data when public_dataset is none


class FederationConfig(StrictModel):
    """How to build a federation. Sizes may be counts (int) or fractions of the dataset (float)."""

    dataset: str = "mnist5k"
    public_dataset: str | None = "digits28"
    data_root: str | None = None
    clients: Annotated[int, Field(ge=1)] = 20
    partition: Literal["dirichlet", "iid", "shards"] = "dirichlet"
    alpha: Annotated[float, Field(gt=0)] = 1.0
    shards_per_client: Annotated[int, Field(ge=1)] = 2
    test_size: Annotated[float, Field(gt=0)] = 0.2
    shadow_size: Annotated[float, Field(ge=0)] = 0.2
    public_size: Annotated[float, Field(ge=0)] = 0.0
    max_public: Annotated[int, Field(ge=0)] = 0
    negative_fraction: Fraction = 0.2
    seed: int = 0

    @field_validator("public_dataset", mode="before")
    @classmethod
    def _none_word(cls, v: object) -> object:
        # "none" (TOML has no null; --set and the CLI pass words) means: no separate public dataset
        return None if isinstance(v, str) and v.strip().lower() in ("none", "") else v

    @model_validator(mode="before")
    @classmethod
    def _carved_public_size(cls, data: object) -> object:
        # without a public dataset, public data is carved from `dataset`: 10 % unless public_size
        # says otherwise (the same default in `privkit data split`, `train` and `run`)
        if (
            isinstance(data, dict)
            and "public_size" not in data
            and "public_dataset" in data
            and cls._none_word(data["public_dataset"]) is None
        ):
            data = {**data, "public_size": CARVED_PUBLIC_SIZE}
        return data

    @model_validator(mode="after")
    def _public_source(self) -> FederationConfig:
        if self.public_dataset is None and self.public_size <= 0:
            raise ValueError(
                f"public_size must be > 0 when public_dataset is None; found {self.public_size}"
            )
        return self


def _size(spec: float, total: int, name: str) -> int:
    n = round(spec * total) if spec < 1 else int(spec)
    if n < 0 or n > total:
        raise PrivkitError(f"{name} must be between 0 and {total}; found {spec}")
    return n


@dataclass
class Federation:
    """Index sets into ``private`` (clients, test, shadow pool) and ``public`` (distill, negative).

    Parameters
    ----------
    config : FederationConfig
        The configuration the federation was built from.
    private : ArrayDataset
        The private dataset: clients' records, test set and shadow pool index into it.
    public : ArrayDataset
        The public/auxiliary dataset (the private one where no ``public_dataset`` is configured).
    clients : list of numpy.ndarray
        Each client's private records, as sorted int64 indices into ``private``.
    test : numpy.ndarray
        Held-out test records (indices into ``private``).
    shadow_pool : numpy.ndarray
        Records reserved for shadow models (indices into ``private``), seen by no client.
    distill : numpy.ndarray
        Public records used for distillation (indices into ``public``).
    negative : numpy.ndarray
        Public records used as negatives (indices into ``public``), e.g. by FedAUX's scores.
    name : str
        ``"target"`` for the released federation, another name for a derived (shadow) one.
    extra : dict
        Free-form data a method attaches to the federation; copied to derived federations.
    """

    config: FederationConfig
    private: ArrayDataset
    public: ArrayDataset
    clients: list[np.ndarray]
    test: np.ndarray
    shadow_pool: np.ndarray
    distill: np.ndarray
    negative: np.ndarray
    name: str = "target"
    extra: dict = field(default_factory=dict)

    # ------------------------------------------------------------------ properties
    @property
    def num_clients(self) -> int:
        return len(self.clients)

    @property
    def num_classes(self) -> int:
        return self.private.num_classes

    @property
    def input_shape(self) -> tuple[int, int, int]:
        return self.private.input_shape

    @property
    def members(self) -> np.ndarray:
        """All private training indices (the union of the clients' data)."""
        return np.sort(np.concatenate(self.clients)) if self.clients else np.zeros(0, np.int64)

    @property
    def public_indices(self) -> np.ndarray:
        return np.sort(np.concatenate([self.distill, self.negative]))

    # ------------------------------------------------------------------ arrays
    def client_arrays(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        idx = self.clients[i]
        return self.private.x[idx], self.private.y[idx]

    def test_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        return self.private.x[self.test], self.private.y[self.test]

    def pooled_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """All clients' data pooled (the centralised baselines)."""
        idx = self.members
        return self.private.x[idx], self.private.y[idx]

    def public_arrays(
        self, part: Literal["all", "distill", "negative"] = "all"
    ) -> tuple[np.ndarray, np.ndarray]:
        idx = {"all": self.public_indices, "distill": self.distill, "negative": self.negative}[part]
        return self.public.x[idx], self.public.y[idx]

    def client_class_counts(self) -> np.ndarray:
        return np.stack([self.private.class_counts(c) for c in self.clients])

    # ------------------------------------------------------------------ derived federations
    def with_clients(self, clients: list[np.ndarray], name: str) -> Federation:
        """The same federation with other client index sets (e.g. a shadow federation).

        Public data, test set and shadow pool stay as they are, so a shadow model is trained exactly
        like the target except for which private records it saw.
        """
        for i, c in enumerate(clients):
            if len(c) and (c.min() < 0 or c.max() >= len(self.private)):
                raise PrivkitError(f"client {i} indices out of range for {self.private.name}")
        return Federation(
            config=self.config,
            private=self.private,
            public=self.public,
            clients=[np.asarray(c, dtype=np.int64) for c in clients],
            test=self.test,
            shadow_pool=self.shadow_pool,
            distill=self.distill,
            negative=self.negative,
            name=name,
            extra=dict(self.extra),
        )

    # ------------------------------------------------------------------ summary / IO
    def summary(self) -> dict:
        counts = self.client_class_counts()
        return {
            "dataset": self.private.name,
            "public_dataset": self.public.name,
            "num_classes": self.num_classes,
            "partition": self.config.partition,
            "alpha": self.config.alpha if self.config.partition == "dirichlet" else None,
            "seed": self.config.seed,
            "sizes": {
                "clients_total": int(counts.sum()),
                "test": len(self.test),
                "shadow_pool": len(self.shadow_pool),
                "distill": len(self.distill),
                "negative": len(self.negative),
            },
            "clients": [{"size": int(c.sum()), "class_counts": c.tolist()} for c in counts],
            "top_class_shares": top_class_shares(counts).tolist(),
        }

    def to_dict(self) -> dict:
        return {
            "schema_version": SCHEMA_VERSION,
            "name": self.name,
            "config": self.config.model_dump(),
            "private_dataset": self.private.name,
            "public_dataset": self.public.name,
            "clients": [c.tolist() for c in self.clients],
            "test": self.test.tolist(),
            "shadow_pool": self.shadow_pool.tolist(),
            "distill": self.distill.tolist(),
            "negative": self.negative.tolist(),
        }

    def save(self, path: str | Path) -> None:
        from privkit.files import write_text

        write_text(path, json.dumps(self.to_dict()))

    @classmethod
    def from_dict(cls, data: dict) -> Federation:
        if data.get("schema_version") != SCHEMA_VERSION:
            raise PrivkitError(
                f"federation schema_version must be {SCHEMA_VERSION}; "
                f"found {data.get('schema_version')!r}"
            )
        cfg = FederationConfig.model_validate(data["config"])
        private = load_dataset(cfg.dataset, cfg.data_root)
        public = load_dataset(cfg.public_dataset, cfg.data_root) if cfg.public_dataset else private
        arr = lambda k: np.asarray(data[k], dtype=np.int64)
        return cls(
            config=cfg,
            private=private,
            public=public,
            clients=[np.asarray(c, dtype=np.int64) for c in data["clients"]],
            test=arr("test"),
            shadow_pool=arr("shadow_pool"),
            distill=arr("distill"),
            negative=arr("negative"),
            name=data.get("name", "target"),
        )

    @classmethod
    def load(cls, path: str | Path) -> Federation:
        from privkit.files import read_json

        p = Path(path)
        data = read_json(p, "federation file")
        try:
            return cls.from_dict(data)
        except (KeyError, TypeError, AttributeError) as exc:
            raise PrivkitError(
                f"federation file {p} is malformed ({type(exc).__name__}: {exc})"
            ) from None


def build_federation(config: FederationConfig | dict) -> Federation:
    """Split the configured dataset(s) into a federation (deterministic in ``config.seed``)."""
    cfg = (
        config if isinstance(config, FederationConfig) else FederationConfig.model_validate(config)
    )
    private = load_dataset(cfg.dataset, cfg.data_root)
    rng = make_rng(cfg.seed, "federation")
    n = len(private)

    if private.test_indices is not None:
        test = np.sort(private.test_indices)
        rest = rng.permutation(np.setdiff1d(np.arange(n), test))
    else:
        perm = rng.permutation(n)
        n_test = _size(cfg.test_size, n, "test_size")
        test, rest = np.sort(perm[:n_test]), perm[n_test:]
    n_shadow = _size(cfg.shadow_size, len(rest), "shadow_size")
    shadow_pool, rest = np.sort(rest[:n_shadow]), rest[n_shadow:]

    if cfg.public_dataset is None:
        public = private
        n_pub = _size(cfg.public_size, len(rest), "public_size")
        public_idx, rest = rest[:n_pub], rest[n_pub:]
    else:
        public = load_dataset(cfg.public_dataset, cfg.data_root)
        if public.input_shape != private.input_shape:
            raise PrivkitError(
                f"public_dataset {public.name} has input shape {public.input_shape}, "
                f"but {private.name} has {private.input_shape}"
            )
        public_idx = rng.permutation(len(public))
    if cfg.max_public:
        public_idx = public_idx[: cfg.max_public]
    n_neg = round(cfg.negative_fraction * len(public_idx))
    negative, distill = np.sort(public_idx[:n_neg]), np.sort(public_idx[n_neg:])

    pool = np.sort(rest)
    if cfg.partition == "dirichlet":
        local = dirichlet_partition(
            private.y[pool], cfg.clients, cfg.alpha, rng, private.num_classes
        )
    elif cfg.partition == "iid":
        local = iid_partition(len(pool), cfg.clients, rng)
    else:
        local = shard_partition(private.y[pool], cfg.clients, cfg.shards_per_client, rng)
    clients = [pool[ix] for ix in local]
    return Federation(
        config=cfg,
        private=private,
        public=public,
        clients=clients,
        test=test,
        shadow_pool=shadow_pool,
        distill=distill,
        negative=negative,
    )
