"""Server strategies, one file per algorithm (registered in :mod:`common.methods`)."""

from common.config import RunConfig
from common.methods import get
from strategies.base import HeteroStrategy, NodeInfo, Upload


def make_strategy(cfg: RunConfig) -> HeteroStrategy:
    """The strategy of ``cfg.algorithm``, built from the run config."""
    cls = get(cfg.algorithm).strategy_class()
    if not (isinstance(cls, type) and issubclass(cls, HeteroStrategy)):
        raise TypeError(f"algorithm {cfg.algorithm!r}: {cls!r} is not a HeteroStrategy subclass")
    return cls.from_config(cfg)


__all__ = ["HeteroStrategy", "NodeInfo", "Upload", "make_strategy"]
