"""Datasets, client partitions and per-client loading.

``load_arrays`` reads a whole dataset; ``prepare_partition`` splits it over
clients once and caches the result on disk; ``load_client_data`` loads one
client's share as normalised tensors.
"""

from data.client import ClientData, load_client_data, load_global_test, load_local_data
from data.datasets import Dataset, load_arrays
from data.store import export_partition, partition_summary, prepare_partition

__all__ = [
    "ClientData",
    "Dataset",
    "export_partition",
    "load_arrays",
    "load_client_data",
    "load_global_test",
    "load_local_data",
    "partition_summary",
    "prepare_partition",
]
