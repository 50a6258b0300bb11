"""What the server survives: one table of injected faults, the same partition and seed
in every row.

20 clients (Fashion-MNIST ``data.fraction=0.05`` by default, about 150 training samples a
client, so the runs stay short; ``--fraction``), Dirichlet 0.5, 10 rounds. The runs go
through the in-process grid the tests use (``server_app/inprocess.py``, the real
ClientApp and ServerApp code, no Ray), whose fault hook turns the replies of 20 % of
the clients (partitions 0, 5, 10, 15) into a hostile kind every round; the hook is not
reachable from a run config.

Malformed rows (fedavg with ``fedavgcnn``, lgfedavg, fedre and fedara on the ``cnn``
family): a clean run; NaN, a wrong shape, float64, int64, a huge num-examples, array
bytes that are no ``.npy`` payload, an empty reply, an error reply; those clients
crashing (no reply); a straggler past ``round-timeout`` (its reply comes too late); the
server killed at the start of round 5 and resumed.

Finite-poison rows (every algorithm that uploads, :data:`ATTACKS`), each with the
defaults and with the robust options (:data:`ROBUST`): one client (partition 0) sends
its upload scaled by 1e6; 20 % send sign-flipped updates; 20 % add the same large
direction (a crafted push); for the per-class uploads, 20 % send each class's
prototype as another's. Plus the clean run with the robust options.

Columns: rounds completed, rejected replies by reason, whether the global state stayed
finite, the final accuracy against the clean run's, and for the resumed row whether its
per-round metrics equal the clean run's.

    python -m benchmarks.faults --out benchmarks/out/faults.json
    # rerun some rows (or algorithms), keeping the others from --out
    python -m benchmarks.faults --out docs/results/faults.json --rows "undecodable bytes"
    python -m benchmarks.faults --out docs/results/faults.json --attacks
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.probe import task_identity

ROOT = Path(__file__).resolve().parent.parent

NODES, ROUNDS, HOSTILE = 20, 10, (0, 5, 10, 15)
ALGORITHMS: dict[str, dict[str, Any]] = {
    "fedavg": {"model.family": "fedavgcnn"},
    "lgfedavg": {},
    "fedre": {},
    "fedara": {},
    "fedlora": {},
    "fml": {},
    "fedkd": {},
    "fedproto": {},
    "fedgh": {},
    "fedtgp": {},
}
"""Every algorithm whose clients upload something (``local`` uploads nothing). The
first four have every row; the others the clean row and the attack rows."""
MALFORMED_ALGORITHMS = ("fedavg", "lgfedavg", "fedre", "fedara")
PROTOTYPE_ALGORITHMS = ("fedre", "fedproto", "fedgh", "fedtgp")
"""Algorithms whose uploads are per-class (prototypes; FedRE's soft labels): they
also get the wrong-class row."""
UPDATE_UPLOADS = ("fedkd",)
"""Algorithms whose uploads are updates already (FedKD: the mentee's update, whole or
as factors): an attack changes the update itself, not ``upload - served``."""
ROBUST: dict[str, dict[str, Any]] = {
    **{a: {"robust.min-cosine": 0.0} for a in ("fedavg", "lgfedavg", "fedara", "fedlora", "fml")},
    "fedkd": {"robust.aggregate": "median"},
    "fedproto": {"robust.aggregate": "median"},
    **{a: {"robust.prototypes": "median"} for a in ("fedgh", "fedtgp")},
}
"""The robust options of an algorithm's ``..., robust`` rows, on top of the default
screening (``robust.max-norm-ratio``, which every row has): direction screening for
the parameter updates it covers; the coordinate-wise median for fedkd's updates and
fedproto's class prototypes (direction screening does not cover them); per-class
medians after the per-class screening (``robust.prototypes = "median"``) for the
servers that train on prototypes (fedgh, fedtgp). FedRE's only option, the screening
against the soft-label mix of class medians (a mixture has no class median to train
on), is on by default: no robust rows.
For fedavg a coordinate-wise median or trimmed mean was tried first: clean it cost 13
and 3.5 points (non-IID updates are not symmetric around their mean) and against 20 %
sign flips it did worse than the mean (docs/robustness.md)."""
KEYS = ("round", "accuracy", "loss", "valid-replies")
RESUMED = "server killed at round 5, resumed"


Fault = Callable[..., Any]
"""``fault(reply, request) -> the reply the server gets instead``."""


def _replace_arrays(make: Callable[[dict[str, np.ndarray]], dict]) -> Fault:
    def fault(reply: Any, request: Any) -> Any:
        from common.records import to_numpy

        if reply.has_error():
            return reply
        arrays = make(to_numpy(reply.content.array_records["arrays"]))
        return with_arrays(reply, request, arrays)

    return fault


def with_arrays(reply: Any, request: Any, arrays: dict[str, np.ndarray]) -> Any:
    """A reply to ``request`` holding every record of ``reply`` but its ``arrays``,
    which become ``arrays``: the metrics and, under ``eval-mode = with-train``, the
    evaluation the training reply carries (``evaluate-metrics``) stay, so that an
    attacked node is still evaluated like every other."""
    from flwr.app import Message, RecordDict

    from common.records import to_record

    records = {name: record for name, record in reply.content.items() if name != "arrays"}
    return Message(RecordDict({"arrays": to_record(arrays), **records}), reply_to=request)


def _huge_count(reply: Any, request: Any) -> Any:
    if not reply.has_error():
        reply.content.metric_records["metrics"]["num-examples"] = 1e12
    return reply


def _error(reply: Any, request: Any) -> Any:
    from flwr.app import Error, Message

    return Message(Error(code=0, reason="injected failure"), reply_to=request)


def _undecodable(reply: Any, request: Any) -> Any:
    """The first array's bytes replaced by two bytes that are no ``.npy`` payload
    (its declared dtype and shape kept)."""
    from flwr.app import Array

    if not reply.has_error():
        record = reply.content.array_records["arrays"]
        key = next(iter(record))
        old = record[key]
        record[key] = Array(dtype=old.dtype, shape=old.shape, stype=old.stype, data=b"\x93N")
    return reply


def _first_shape_broken(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    key = next(iter(arrays))
    return {**arrays, key: np.zeros((*arrays[key].shape, 2), np.float32)}


FAULTS: dict[str, Fault] = {
    "nan": _replace_arrays(lambda a: {k: np.full_like(v, np.nan) for k, v in a.items()}),
    "wrong shape": _replace_arrays(_first_shape_broken),
    "float64": _replace_arrays(lambda a: {k: v.astype(np.float64) for k, v in a.items()}),
    "int64": _replace_arrays(lambda a: {k: v.astype(np.int64) for k, v in a.items()}),
    "huge num-examples": _huge_count,
    "undecodable bytes": _undecodable,
    "empty": _replace_arrays(lambda a: {}),
    "error": _error,
}


def _served(request: Any) -> dict[str, np.ndarray]:
    from common.records import to_numpy

    records = request.content.array_records
    return to_numpy(records["arrays"]) if "arrays" in records else {}


def _attack(make: Callable[[dict[str, np.ndarray], dict[str, np.ndarray]], dict]) -> Fault:
    """A hostile reply built from the honest one and what the node was sent."""

    def fault(reply: Any, request: Any, updates: bool = False) -> Any:
        from common.records import to_numpy

        if reply.has_error():
            return reply
        up = to_numpy(reply.content.array_records["arrays"])
        served = {} if updates else _served(request)
        arrays = {k: v.astype(up[k].dtype) for k, v in make(up, served).items()}
        return with_arrays(reply, request, arrays)

    return fault


def _base(key: str, value: np.ndarray, served: dict[str, np.ndarray]) -> np.ndarray:
    """What an upload's array is an update to: the served array of the same key and
    shape (parameter uploads), else zero (prototypes, representations, FedKD's
    update factors)."""
    ref = served.get(key)
    if ref is not None and ref.shape == value.shape:
        return ref.astype(np.float64)
    return np.zeros(value.shape)


def _flip(up: dict[str, np.ndarray], served: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every update sign-flipped (``2 served - upload``; of a factor pair only the
    left factor, so that its product flips)."""
    from common.messages import FACTOR_VT

    out = {}
    for k, v in up.items():
        if k.endswith(FACTOR_VT) or k.endswith(".v"):
            out[k] = v
        else:
            base = _base(k, v, served)
            out[k] = 2 * base - v.astype(np.float64)
    return out


PUSH_SCALE = 10.0
"""A crafted push: the honest upload plus one fixed direction (the same for every
attacker) of ``PUSH_SCALE`` x the honest update's norm."""


def _push(up: dict[str, np.ndarray], served: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1234)  # the same direction for every attacker
    direction = {k: rng.standard_normal(v.shape) for k, v in sorted(up.items())}
    norm = np.sqrt(sum(float(np.square(d).sum()) for d in direction.values()))
    honest = np.sqrt(sum(float(np.square(v - _base(k, v, served)).sum()) for k, v in up.items()))
    size = PUSH_SCALE * max(honest, 1e-3)
    return {k: v.astype(np.float64) + size * direction[k] / norm for k, v in up.items()}


def _wrong_class(up: dict[str, np.ndarray], served: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each class's prototype sent as the next class's (FedRE: its soft labels
    shifted by one class)."""
    from common.messages import PROTO, SOFT_LABEL

    protos = sorted((k for k in up if k.startswith(PROTO)), key=lambda k: int(k[len(PROTO) :]))
    out = dict(up)
    for k, nxt in zip(protos, protos[1:] + protos[:1], strict=True):
        out[k] = up[nxt]
    if SOFT_LABEL in up:
        out[SOFT_LABEL] = np.roll(up[SOFT_LABEL], 1, axis=1)
    return out


def _values_only(
    make: Callable[[dict[str, np.ndarray], dict[str, np.ndarray]], dict],
) -> Callable[[dict[str, np.ndarray], dict[str, np.ndarray]], dict]:
    """``make`` applied to everything but FedRE's soft labels, which stay valid
    distributions (else the reply is rejected as malformed, not as poison)."""
    from common.messages import SOFT_LABEL

    def apply(up: dict[str, np.ndarray], served: dict[str, np.ndarray]) -> dict:
        keep = {k: v for k, v in up.items() if k == SOFT_LABEL}
        rest = {k: v for k, v in up.items() if k != SOFT_LABEL}
        return {**make(rest, served), **keep}

    return apply


ATTACKS: dict[str, Fault] = {
    "1e6-scaled (one client)": _attack(
        _values_only(lambda up, _: {k: v * 1e6 for k, v in up.items()})
    ),
    "sign-flipped": _attack(_values_only(_flip)),
    "crafted push": _attack(_values_only(_push)),
    "wrong-class prototypes": _attack(_wrong_class),
}
"""Finite, well-formed poison: each from 20 % of the clients (the first from
partition 0 only)."""


ATTACK_NAMES = (*ATTACKS, "clean, robust")


def rows_of(algorithm: str) -> list[str]:
    """The rows ``algorithm`` runs: every fault for the first four algorithms, then
    the attacks with the defaults and with :data:`ROBUST` (and the clean run with it)."""
    rows = ["clean"]
    if algorithm in MALFORMED_ALGORITHMS:
        rows += [*FAULTS, "crash", "straggler past round-timeout", RESUMED]
    attacks = [a for a in ATTACKS if a != "wrong-class prototypes"]
    if algorithm in PROTOTYPE_ALGORITHMS:
        attacks.append("wrong-class prototypes")
    rows += attacks
    if algorithm in ROBUST:
        # (the 1e6-scaled reply is rejected by the default screening already)
        rows += ["clean, robust", "sign-flipped, robust", "crafted push, robust"]
        if algorithm in PROTOTYPE_ALGORITHMS:
            rows.append("wrong-class prototypes, robust")
    return rows


FRACTION = 0.05
"""Default share of Fashion-MNIST the 20 clients split."""


def run_row(tmp: Path, algorithm: str, row: str, fraction: float = FRACTION) -> dict[str, Any]:
    """One run of ``algorithm`` with fault ``row``; its rows and what was rejected."""
    from client_app.app import app as client_app
    from common.config import parse_run_config
    from server_app.app import serve
    from server_app.inprocess import FakeGrid, small_config

    overrides = {
        "algorithm": algorithm,
        "num-server-rounds": ROUNDS,
        "data.name": "fashion-mnist",
        "data.fraction": fraction,
        "data.alpha": 0.5,
        "train.batch-size": 10,
        "round-timeout": 60.0,
        **ALGORITHMS[algorithm],
        **(ROBUST.get(algorithm, {}) if row.endswith(", robust") else {}),
        "out-dir": str(tmp / algorithm / row.replace(" ", "-").replace(",", "")),
    }
    fault_name = row.removesuffix(", robust")

    class Grid(FakeGrid):
        """The in-process grid with this row's fault."""

        crash_at = 5 if row == RESUMED else None

        def send_and_receive(self, messages, *, timeout=None):  # type: ignore[no-untyped-def]
            messages = list(messages)
            kinds = {m.metadata.message_type.split(".")[0] for m in messages}
            rounds = {int(m.content["config"].get("server-round", 0)) for m in messages}
            if self.crash_at in rounds and "train" in kinds:
                raise KeyboardInterrupt("server killed")
            replies = super().send_and_receive(messages, timeout=timeout)
            if "train" not in kinds:
                return replies
            hostile = {self.node_of_partition(p) for p in HOSTILE}
            if row == "crash":  # those clients died mid-round: no reply
                return [r for r in replies if r.metadata.src_node_id not in hostile]
            if row == "straggler past round-timeout":  # one reply after the deadline
                return [r for r in replies if r.metadata.src_node_id != self.node_of_partition(0)]
            return replies

    run_config = small_config(tmp, **overrides)
    grid = Grid(client_app, run_config, NODES)
    fault = FAULTS.get(fault_name) or ATTACKS.get(fault_name)
    if fault_name in ATTACKS and algorithm in UPDATE_UPLOADS:
        fault = functools.partial(ATTACKS[fault_name], updates=True)
    if fault is not None:
        hostile = HOSTILE[:1] if fault_name.startswith("1e6") else HOSTILE
        for pid in hostile:  # the request is the message just sent to that node
            grid.faults[grid.node_of_partition(pid)] = lambda r: fault(r, grid.sent[-1])
    cfg = parse_run_config(run_config)
    try:
        path = serve(grid, cfg, simulation=True)  # type: ignore[arg-type]
    except KeyboardInterrupt:
        resumed = {**run_config, "resume": overrides["out-dir"]}
        fresh = FakeGrid(client_app, resumed, NODES)
        path = serve(fresh, parse_run_config(resumed), True)  # type: ignore[arg-type]
    doc = json.loads(path.read_text())
    return {
        "rounds": [{k: r[k] for k in KEYS} for r in doc["rounds"]],
        "rejected": collections.Counter(
            reason_kind(r["reason"]) for r in doc["summary"]["rejected-replies"]
        ),
        "missing": sum(r["missing-replies"] for r in doc["rounds"]),
        "accuracy": doc["summary"]["accuracy-last"],
        "finite": finite_global(path.parent),
    }


REASONS = (
    "non-finite",
    "not a .npy payload",
    "dtype",
    "num-examples",
    "wrong keys",
    "wrong shape",
    "error reply",
    "robust.max-norm-ratio",
    "update direction",
    "class screening",
    "not a distribution",
)


def reason_kind(reason: str) -> str:
    """A rejection's kind (its text names the node's array, values, sizes)."""
    return next((kind for kind in REASONS if kind in reason), reason.split(":")[0])


def finite_global(out_dir: Path) -> bool:
    """Whether the checkpointed global state holds only finite numbers."""
    from server_app import checkpoint

    state = checkpoint.read(out_dir)["strategy"]
    return all(np.isfinite(v).all() for v in state["global"].values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/out/faults.json")
    ap.add_argument("--algorithms", default=",".join(ALGORITHMS))
    ap.add_argument("--fraction", type=float, default=FRACTION, help="data.fraction")
    ap.add_argument(
        "--rows",
        default="",
        help="comma (or, for names with a comma, semicolon) list of rows to (re)run "
        "(default: all); the others are kept from --out",
    )
    ap.add_argument(
        "--attacks",
        action="store_true",
        help="(re)run only the clean and the finite-poison rows (keeping the others)",
    )
    ap.add_argument(
        "--missing-only",
        action="store_true",
        help="run only the wanted rows that --out does not have yet",
    )
    args = ap.parse_args()
    task_identity()
    every = sorted({r for a in ALGORITHMS for r in rows_of(a)})
    sep = ";" if ";" in args.rows else ","  # (some row names hold a comma)
    wanted = [r for r in args.rows.split(sep) if r] or every
    if args.attacks:
        wanted = [r for r in every if r == "clean" or r.startswith(ATTACK_NAMES)]
    unknown = set(wanted) - set(every)
    if unknown:
        raise SystemExit(f"unknown rows {sorted(unknown)}; rows: {every}")
    algorithms = args.algorithms.split(",")
    kept: dict[tuple[str, str], dict[str, Any]] = {}
    if args.rows or args.attacks or set(algorithms) != set(ALGORITHMS):
        # a partial run: what it does not rerun is kept from --out
        if not args.out.exists():
            raise SystemExit(f"{args.out} does not exist (run every row first)")
        old = json.loads(args.out.read_text())
        if old["fraction"] != args.fraction:
            raise SystemExit(f"{args.out} was made with fraction {old['fraction']}")
        kept = {(e["algorithm"], e["row"]): e for e in old["rows"]}
    table = []
    with tempfile.TemporaryDirectory() as tmp:
        for algorithm in ALGORITHMS:
            rows = rows_of(algorithm)
            todo = [r for r in rows if r in wanted and algorithm in algorithms]
            if args.missing_only:
                todo = [r for r in todo if (algorithm, r) not in kept]
            if not todo:
                table += [kept[(algorithm, r)] for r in rows if (algorithm, r) in kept]
                continue
            clean = run_row(Path(tmp), algorithm, "clean", args.fraction)
            for row in rows:
                if row not in todo:
                    if (algorithm, row) in kept:
                        table.append(kept[(algorithm, row)])
                    continue
                got = clean if row == "clean" else run_row(Path(tmp), algorithm, row, args.fraction)
                entry = {
                    "algorithm": algorithm,
                    "row": row,
                    "rounds-completed": len(got["rounds"]),
                    "rejected": dict(got["rejected"]),
                    "missing": got["missing"],
                    "finite": got["finite"],
                    "accuracy": got["accuracy"],
                    "accuracy-clean": clean["accuracy"],
                    "equals-clean": got["rounds"] == clean["rounds"],
                }
                table.append(entry)
                print(json.dumps(entry), flush=True)
                write(args, table)
    write(args, table)


def robust_defaults() -> dict[str, Any]:
    """The ``robust.*`` defaults every row runs with (the ``robust`` rows add
    :data:`ROBUST` on top)."""
    from common.config import RunConfig

    return {f"robust.{k.replace('_', '-')}": v for k, v in RunConfig().robust.model_dump().items()}


def write(args: argparse.Namespace, table: list[dict[str, Any]]) -> None:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "nodes": NODES,
        "rounds": ROUNDS,
        "fraction": args.fraction,
        "defaults": robust_defaults(),
        "robust-options": ROBUST,
        "rows": table,
    }
    args.out.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
