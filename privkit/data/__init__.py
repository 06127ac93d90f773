"""Datasets (embedded and local), partitions among clients, and federations."""

from privkit.data.datasets import DATASETS, ArrayDataset, load_dataset
from privkit.data.federation import Federation, FederationConfig, build_federation
from privkit.data.partition import (
    dirichlet_partition,
    iid_partition,
    shard_partition,
    top_class_shares,
)

__all__ = [
    "DATASETS",
    "ArrayDataset",
    "Federation",
    "FederationConfig",
    "build_federation",
    "dirichlet_partition",
    "iid_partition",
    "load_dataset",
    "shard_partition",
    "top_class_shares",
]
