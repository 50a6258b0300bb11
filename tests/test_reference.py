"""A change in numerics is a decision, not an accident: a small reference configuration
(3 nodes, synthetic data, 2 rounds, seed 0, in process) gives exactly the per-client
accuracies and training losses, and each round's evaluation loss, committed in
``tests/reference_accuracies.json`` (accuracies alone miss most small changes: counts of
correct predictions on a few hundred samples).

``python -m tests.test_reference`` compares every method and prints what moved;
``--add`` writes the numbers of methods the file does not have yet (a new method);
``--write`` rewrites every method's, when a change is meant to move them (say so in the
commit). A few methods run in the fast tier, the others with ``slow``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from common import methods
from server_app.inprocess import run_inprocess

REFERENCE = Path(__file__).with_name("reference_accuracies.json")
FAST = ("lgfedavg", "fedre", "fedgh", "fedara")
"""Methods checked in the fast tier (about 20 s together); the rest are ``slow``."""


def run(algorithm: str, tmp_path: Path) -> dict[str, dict[str, Any]]:
    """Round -> ``accuracy`` (partition -> accuracy), ``train-loss`` (partition ->
    its training loss) and ``loss`` (the evaluation's) of the reference configuration."""
    overrides: dict[str, Any] = {"model.family": "fedavgcnn" if algorithm == "fedavg" else "cnn"}
    res, _ = run_inprocess(tmp_path, algorithm=algorithm, **overrides)
    return {
        str(r["round"]): {
            "accuracy": r["client-accuracy"],
            "train-loss": {p: m["train-loss"] for p, m in r["client-train"].items()},
            "loss": r["loss"],
        }
        for r in res["rounds"]
    }


def reference() -> dict[str, Any]:
    return json.loads(REFERENCE.read_text())


def check(algorithm: str, tmp_path: Path) -> None:
    want = reference()["accuracies"][algorithm]
    got = run(algorithm, tmp_path)
    assert got == want, (
        f"{algorithm}: the reference numbers moved\n"
        f"  reference: {want}\n  now:       {got}\n"
        "if the change is meant to move them: python -m tests.test_reference --write"
    )


def test_the_reference_covers_every_method() -> None:
    assert set(reference()["accuracies"]) == set(m.name for m in methods.BUILTIN)


@pytest.mark.parametrize("algorithm", FAST)
def test_per_client_accuracies_equal_the_reference(algorithm: str, tmp_path: Path) -> None:
    check(algorithm, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", [m.name for m in methods.BUILTIN if m.name not in FAST])
def test_per_client_accuracies_equal_the_reference_slow(algorithm: str, tmp_path: Path) -> None:
    check(algorithm, tmp_path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--add", action="store_true", help="add the methods the file lacks")
    mode.add_argument("--write", action="store_true", help="rewrite every method's numbers")
    args = parser.parse_args(argv)
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 0  # as conftest
    old = reference()["accuracies"] if REFERENCE.exists() else {}
    new, moved = dict(old), []
    for method in methods.BUILTIN:
        if args.add and method.name in old:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            numbers = run(method.name, Path(tmp))
        state = "new" if method.name not in old else "same"
        if state == "same" and numbers != old[method.name]:
            state = "MOVED"
            moved.append(method.name)
        print(f"{method.name}: {state}", file=sys.stderr)
        if args.write or state == "new" and args.add:
            new[method.name] = numbers
    if args.add or args.write:
        doc = {
            "what": "round -> per-client accuracy and train-loss, evaluation loss, of "
            "server_app.inprocess.run_inprocess(3 nodes, synthetic data, 2 rounds, seed 0)",
            "made-by": "python -m tests.test_reference --write (methods added: --add)",
            "accuracies": {m.name: new[m.name] for m in methods.BUILTIN if m.name in new},
        }
        REFERENCE.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return 1 if moved and not args.write else 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
