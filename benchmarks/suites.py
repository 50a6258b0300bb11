"""The accuracy benchmark's rows: regimes, suites and when a run is complete.

Shared by ``benchmarks/accuracy.py`` (runs the rows), ``benchmarks/results_page.py``
(tables from their archived runs) and ``benchmarks/privacy.py`` (the scarce regime).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from cli.launch import Scalar

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "out"
ROUNDS = 30

REGIMES: dict[str, dict] = {
    "scarce": {
        "clients": 50,
        "seeds": (0, 1, 2),
        "config": {"data.fraction": 0.2, "data.alpha": 0.5},
    },
    "practical": {
        "clients": 20,
        "seeds": (0,),
        "config": {"data.fraction": 1.0, "data.alpha": 0.1},
    },
}


@dataclass(frozen=True)
class Spec:
    """One benchmark row: a name, its overrides, the regimes it runs in."""

    name: str
    overrides: dict[str, Scalar] = field(default_factory=dict)
    regimes: tuple[str, ...] = ("scarce", "practical")


def _dotted(key: str) -> str:
    """``fedre__server_epochs`` -> ``fedre.server-epochs``."""
    return key.replace("__", ".").replace("_", "-")


def variant(name: str, algorithm: str, **keys: Scalar) -> Spec:
    """A scarce-regime row (ablations, variants): ``algorithm`` with run-config
    overrides given as ``section__key_name=value``."""
    return Spec(
        name, {"algorithm": algorithm, **{_dotted(k): v for k, v in keys.items()}}, ("scarce",)
    )


PAPER_REGIME: dict[str, Scalar] = {
    "train__local_epochs": 5,
    "train__batch_size": 16,
    "train__lr": 0.005,
}
"""The FedARA paper's local training: 5 epochs, batch 16, lr 0.005."""

SVD: dict[str, Scalar] = {"fedara.truncation": "svd"}
"""FedARA rows measured while every tier was served the truncated SVD (the default
before ``tracked``)."""

BASELINES = [Spec("local", {"algorithm": "local"}), Spec("lgfedavg", {"algorithm": "lgfedavg"})]
FEDRE_VARIANTS: dict[str, dict[str, Scalar]] = {
    "e20": {"fedre__server_epochs": 20},
    "e100": {"fedre__server_epochs": 100},
    "b10": {"fedre__server_batch_size": 10},
    "lr0.1": {"fedre__server_lr": 0.1},
    "e100-b10": {"fedre__server_epochs": 100, "fedre__server_batch_size": 10},
    "e20-b10-lr0.1": {
        "fedre__server_epochs": 20,
        "fedre__server_batch_size": 10,
        "fedre__server_lr": 0.1,
    },
    "sum": {"fedre__server_loss": "sum"},
    "vap": {"fedre__mix": "vap"},
    "rsr": {"fedre__mix": "rsr"},
    "reps5": {"fedre__reps_per_client": 5},
    "reps10": {"fedre__reps_per_client": 10},
    "reps10-e100-b10": {
        "fedre__reps_per_client": 10,
        "fedre__server_epochs": 100,
        "fedre__server_batch_size": 10,
    },
    "reps10-e100-b10-rsr": {
        "fedre__reps_per_client": 10,
        "fedre__server_epochs": 100,
        "fedre__server_batch_size": 10,
        "fedre__mix": "rsr",
    },
}
FEDLORA_VARIANTS: dict[str, dict[str, Scalar]] = {
    "rep": {"fedlora__targets": "rep"},
    "rep-lr0.1": {"fedlora__targets": "rep", "fedlora__lr": 0.1},
    "head-lr0.1": {"fedlora__lr": 0.1},
    "rank2": {"fedlora__rank": 2},
    "rank32": {"fedlora__rank": 32},
    "alpha32": {"fedlora__alpha": 32.0},
}
SUITES: dict[str, list[Spec]] = {
    "fedre": [
        Spec("fedre", {"algorithm": "fedre"}),
        Spec("fedgh", {"algorithm": "fedgh"}),
        Spec("fedproto", {"algorithm": "fedproto"}),
        variant("fedproto-proto", "fedproto", fedproto__infer="proto"),
        variant("fedgh-e1-b32", "fedgh", fedgh__server_epochs=1, fedgh__server_batch_size=32),
        *(variant(f"fedre-{tag}", "fedre", **keys) for tag, keys in FEDRE_VARIANTS.items()),
    ],
    "init": [
        variant("fedproto-proto-shared", "fedproto", fedproto__infer="proto", model__init="shared"),
        variant("fedre-shared", "fedre", model__init="shared"),
        variant("lgfedavg-shared", "lgfedavg", model__init="shared"),
        variant("local-shared", "local", model__init="shared"),
    ],
    "fedara": [
        Spec("fedara", {"algorithm": "fedara"}),
        # the earlier default (every tier served the truncated SVD) and the rows measured
        # with it: they keep fedara.truncation=svd
        Spec("fedara-svd", {"algorithm": "fedara", **SVD}),
        Spec("fedara-delta", {"algorithm": "fedara", "fedara.aggregation": "delta", **SVD}),
        # the rules at the paper's server step (η = 1)
        variant(
            "fedara-delta-slr1",
            "fedara",
            fedara__aggregation="delta",
            fedara__server_lr=1.0,
            fedara__truncation="svd",
        ),
        variant(
            "fedara-reconstruct-slr1",
            "fedara",
            fedara__aggregation="reconstruct",
            fedara__served_scale="none",
            fedara__server_lr=1.0,
            fedara__truncation="svd",
        ),
        Spec(
            "fedara-reconstruct",
            {
                "algorithm": "fedara",
                "fedara.aggregation": "reconstruct",
                "fedara.served-scale": "none",
                **SVD,
            },
        ),
        variant("fedara-noscale", "fedara", fedara__served_scale="none", fedara__truncation="svd"),
        Spec(
            "fedara-star",
            {
                "algorithm": "fedara",
                "model.family": "fedavgcnn",
                "fedara.rank-tiers": "0.5",
                "fedara.lambda": 10.0,
                **SVD,
            },
        ),
        # λ = 0 also in the practical regime, where the anchor gradient is 0.76 of CE's
        Spec("fedara-lambda0", {"algorithm": "fedara", "fedara.lambda": 0.0, **SVD}),
        *(
            variant(f"fedara-lambda{lam:g}", "fedara", fedara__lambda=lam, fedara__truncation="svd")
            for lam in (0.5, 10.0)
        ),
        variant("fedara-slr5", "fedara", fedara__server_lr=5.0, fedara__truncation="svd"),
        # η = 1 and 2 also in the practical regime, where η = 3 oscillates
        *(
            Spec(f"fedara-slr{eta:g}", {"algorithm": "fedara", "fedara.server-lr": eta, **SVD})
            for eta in (1.0, 2.0)
        ),
        # the same without low-rank tiers: what the factorisation itself costs
        variant("fedara-tiers1", "fedara", fedara__rank_tiers="1", fedara__truncation="svd"),
        variant("fedara-paper-regime", "fedara", **PAPER_REGIME, fedara__truncation="svd"),
        *(variant(f"{a}-paper-regime", a, **PAPER_REGIME) for a in ("local", "lgfedavg")),
        # with the tracked default: the anchors, and the server step
        Spec("fedara-tracked-lambda0", {"algorithm": "fedara", "fedara.lambda": 0.0}),
        Spec("fedara-tracked-slr1", {"algorithm": "fedara", "fedara.server-lr": 1.0}),
        variant("fedara-tracked-paper-regime", "fedara", **PAPER_REGIME),
        *(
            variant(f"fedara-tracked-lambda{lam:g}", "fedara", fedara__lambda=lam)
            for lam in (0.5, 10.0)
        ),
        Spec(
            "fedara-tracked-star",
            {
                "algorithm": "fedara",
                "model.family": "fedavgcnn",
                "fedara.rank-tiers": "0.5",
                "fedara.lambda": 10.0,
            },
        ),
    ],
    "fedlora": [
        Spec("fedlora", {"algorithm": "fedlora"}),
        *(variant(f"fedlora-{tag}", "fedlora", **keys) for tag, keys in FEDLORA_VARIANTS.items()),
    ],
    "baselines": [
        Spec("fedtgp", {"algorithm": "fedtgp"}),
        Spec("fedkd", {"algorithm": "fedkd"}),
        Spec("fml", {"algorithm": "fml"}),
        Spec("fd", {"algorithm": "fd"}),
        Spec("fedgen", {"algorithm": "fedgen"}),
        Spec("fedmrl", {"algorithm": "fedmrl"}),
        Spec("fedmrl-own", {"algorithm": "fedmrl", "fedmrl.predict-head": "own"}),
        Spec(
            "fedmrl-trained",
            {"algorithm": "fedmrl", "fedmrl.predict-with": "trained", "fedmrl.predict-head": "own"},
        ),
        Spec("fedmrl-both", {"algorithm": "fedmrl", "fedmrl.predict-head": "both"}),
        Spec("fedl2g", {"algorithm": "fedl2g"}),
        Spec("fedl2gl", {"algorithm": "fedl2gl"}),
    ],
}


FEDARA_ARCHIVED: dict[str, Scalar] = {"fedara.server-step": "fixed"}
"""Every archived FedARA row ran before ``fedara.server-step`` existed, with the fixed η
(``results_page.ADDED``). With 50 replies in every round (the scarce regime) the bounded
default takes η = 3 in every round too, so those runs are the default's as well; the
practical regime's rows (20 replies) are the fixed rule's (docs/results/small-fleets.md)."""


def _as_archived(spec: Spec) -> Spec:
    if spec.overrides.get("algorithm") != "fedara" or "fedara.server-step" in spec.overrides:
        return spec
    return Spec(spec.name, {**spec.overrides, **FEDARA_ARCHIVED}, spec.regimes)


SUITES = {suite: [_as_archived(spec) for spec in specs] for suite, specs in SUITES.items()}


def complete(path: Path) -> bool:
    try:
        doc = json.loads((path / "results.json").read_text())
        return len(doc["rounds"]) == ROUNDS and doc["summary"]["wall-time-s"] > 0
    except (OSError, ValueError, KeyError):
        return False
