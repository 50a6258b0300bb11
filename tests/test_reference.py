"""A change in numerics is a decision, not an accident: a small reference configuration
(3 nodes, synthetic data, 2 rounds, seed 0, in process) gives exactly the per-client
accuracies and training losses, and each round's evaluation loss, committed in
``tests/reference_accuracies.json`` (accuracies alone miss most small changes: counts of
correct predictions on a few hundred samples).

``python -m tests.test_reference`` compares every method and prints what moved;
``--add`` writes the numbers of methods the file does not have yet (a new method);
``--write`` rewrites every method's, when a change is meant to move them (say so in the
commit). A few methods run in the fast tier, the others with ``slow``.

The last digits also depend on the machine: torch's CPU kernels differ by instruction
set (AVX512, AVX2, ARM ...), and the same run with AVX2 kernels instead of AVX512 moves
losses by up to 4e-4 (relative) and a client's accuracy by one test sample. So the
comparison is exact on a machine whose identity (:func:`common.provenance.machine_identity`)
is the one the file records, and within :data:`LOSS_RTOL` / :data:`ACCURACY_ATOL`
elsewhere (a check that still catches a change of method, not one of summation order).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from benchmarks.reproduce import AVX2
from common import methods
from common.provenance import machine_identity
from server_app.inprocess import run_inprocess

REFERENCE = Path(__file__).with_name("reference_accuracies.json")
ROOT = REFERENCE.parent.parent
FAST = ("lgfedavg", "fedre", "fedgh", "fedara")
"""Methods checked in the fast tier (about 20 s together); the rest are ``slow``."""
LOSS_RTOL = 5e-3
"""On other kernels: training and evaluation losses within this relative difference."""
ACCURACY_ATOL = 0.02
"""On other kernels: each client's accuracy within this (2-3 of its ~150 test samples)."""


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


def same_kernels() -> bool:
    """This machine runs the kernels the reference was made with."""
    return bool(reference().get("machine") == machine_identity())


def moved(want: dict[str, Any], got: dict[str, Any]) -> list[str]:
    """What differs beyond the tolerances (round, partition, quantity), [] if nothing."""
    if set(want) != set(got):
        return [f"rounds {sorted(want)} != {sorted(got)}"]
    out = []
    for rnd, w in want.items():
        g = got[rnd]
        for key, tol, rel in (("accuracy", ACCURACY_ATOL, False), ("train-loss", LOSS_RTOL, True)):
            if set(w[key]) != set(g[key]):
                out.append(f"round {rnd} {key}: partitions {sorted(w[key])} != {sorted(g[key])}")
                continue
            for p, value in w[key].items():
                bound = tol * abs(value) if rel else tol
                if not abs(g[key][p] - value) <= bound:
                    out.append(f"round {rnd} partition {p} {key}: {value} -> {g[key][p]}")
        if not abs(g["loss"] - w["loss"]) <= LOSS_RTOL * abs(w["loss"]):
            out.append(f"round {rnd} loss: {w['loss']} -> {g['loss']}")
    return out


def differences(want: dict[str, Any], got: dict[str, Any]) -> list[str]:
    """What differs under the rule of this machine: anything at all on the reference's
    kernels, beyond the tolerances on others; [] if nothing."""
    if same_kernels():
        return [] if got == want else [f"reference: {want}", f"now:       {got}"]
    return moved(want, got)


def check(algorithm: str, tmp_path: Path) -> None:
    beyond = differences(reference()["accuracies"][algorithm], run(algorithm, tmp_path))
    rule = (
        "exactly (the reference's CPU kernels)"
        if same_kernels()
        else f"beyond what other CPU kernels explain (this machine {machine_identity()}, "
        f"the reference's {reference().get('machine')})"
    )
    assert not beyond, (
        f"{algorithm}: the reference numbers moved {rule}:\n  "
        + "\n  ".join(beyond)
        + "\nif the change is meant to move them: python -m tests.test_reference --write"
    )


def test_the_reference_covers_every_method() -> None:
    assert set(reference()["accuracies"]) == set(m.name for m in methods.BUILTIN)


def test_the_tolerance_names_what_moved_beyond_it() -> None:
    want = {
        "1": {"accuracy": {"0": 0.5, "1": 0.25}, "train-loss": {"0": 2.0, "1": 1.0}, "loss": 1.5}
    }
    near = {
        "1": {"accuracy": {"0": 0.51, "1": 0.25}, "train-loss": {"0": 2.009, "1": 1.0}, "loss": 1.5}
    }
    assert moved(want, want) == [] and moved(want, near) == []
    far = {
        "1": {"accuracy": {"0": 0.5, "1": 0.3}, "train-loss": {"0": 2.02, "1": 1.0}, "loss": 1.6}
    }
    assert moved(want, far) == [
        "round 1 partition 1 accuracy: 0.25 -> 0.3",
        "round 1 partition 0 train-loss: 2.0 -> 2.02",
        "round 1 loss: 1.5 -> 1.6",
    ]
    nan = {"1": {**want["1"], "loss": float("nan")}}
    assert moved(want, nan) == ["round 1 loss: 1.5 -> nan"]
    assert moved(want, {}) != []


@pytest.mark.slow  # a whole in-process run: in the full tier (the fast tier stays under 3 min)
def test_other_cpu_kernels_move_the_last_digits_within_the_tolerance(tmp_path: Path) -> None:
    """A machine without AVX512, emulated: torch, oneDNN and MKL told to use AVX2 kernels.
    The numbers stay within the tolerance the comparison allows on other machines; on an
    AVX512 machine they do move (which is why the exact comparison needs the same kernels)."""
    import torch

    env = {**os.environ, **AVX2}
    code = (
        "import json, sys; from pathlib import Path\n"
        "from flwr.supercore.task_identity import TaskIdentity\n"
        "TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 0\n"
        "from tests.test_reference import run\n"
        "print('NUMBERS', json.dumps(run('fedara', Path(sys.argv[1]))))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("NUMBERS "))
    got = json.loads(line.removeprefix("NUMBERS "))
    want = reference()["accuracies"]["fedara"]
    assert moved(want, got) == []
    if torch.backends.cpu.get_cpu_capability() == "AVX512":
        assert got != want


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
    new, changed = dict(old), []
    for method in methods.BUILTIN:
        if args.add and method.name in old:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            numbers = run(method.name, Path(tmp))
        state = "new" if method.name not in old else "same"
        if state == "same" and numbers != old[method.name]:
            if differences(old[method.name], numbers):
                state = "MOVED"
                changed.append(method.name)
            else:
                state = "within tolerance (other CPU kernels than the reference's)"
        print(f"{method.name}: {state}", file=sys.stderr)
        if args.write or state == "new" and args.add:
            new[method.name] = numbers
    if args.add or args.write:
        doc = {
            "what": "round -> per-client accuracy and train-loss, evaluation loss, of "
            "server_app.inprocess.run_inprocess(3 nodes, synthetic data, 2 rounds, seed 0)",
            "made-by": "python -m tests.test_reference --write (methods added: --add)",
            "machine": reference().get("machine")
            if REFERENCE.exists() and not args.write
            else machine_identity(),
            "accuracies": {m.name: new[m.name] for m in methods.BUILTIN if m.name in new},
        }
        REFERENCE.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return 1 if changed and not args.write else 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
