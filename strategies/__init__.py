"""Server strategies, one file per algorithm; :data:`STRATEGIES` maps name -> class."""

from strategies.base import HeteroStrategy, NodeInfo, Upload
from strategies.fedara import FedARA
from strategies.fedavg import FedAvg
from strategies.fedgh import FedGH
from strategies.fedkd import FedKD
from strategies.fedlora import FedLoRA
from strategies.fedproto import FedProto
from strategies.fedre import FedRE
from strategies.fedtgp import FedTGP
from strategies.fml import FML
from strategies.lgfedavg import LGFedAvg
from strategies.local import Local

STRATEGIES: dict[str, type[HeteroStrategy]] = {
    cls.name: cls
    for cls in (
        Local,
        FedAvg,
        LGFedAvg,
        FedProto,
        FedGH,
        FedRE,
        FedARA,
        FedLoRA,
        FedTGP,
        FedKD,
        FML,
    )
}

__all__ = ["STRATEGIES", "HeteroStrategy", "NodeInfo", "Upload"]
