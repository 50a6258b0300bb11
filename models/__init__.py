"""Model zoo: heterogeneous client models ``extractor -> RM -> head``."""

from models.families import (
    ARCHITECTURES,
    FAMILIES,
    NATURAL_DIM,
    arch_for_partition,
    build_model,
    extractor_out_features,
    family_archs,
    natural_dim,
    smallest_arch,
)
from models.nets import HetNet, represent

__all__ = [
    "ARCHITECTURES",
    "FAMILIES",
    "NATURAL_DIM",
    "HetNet",
    "arch_for_partition",
    "build_model",
    "extractor_out_features",
    "family_archs",
    "natural_dim",
    "represent",
    "smallest_arch",
]
