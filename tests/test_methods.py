"""The extension path: a method defined entirely in this module, registered and run.

``toyhead`` is docs/adding-a-method.md's method with settings, registered from outside
the project (the page's built-in example, ``medhead``, is run by
tests/test_adding_a_method.py): clients upload their trained head,
the server moves the global head towards the *unweighted* mean of the uploads by
``toyhead.server-mix``. It touches no project file: its config section, strategy,
client hook and registration live here, and it runs 2 rounds through the real
ClientApp (real training on synthetic data) and the real result recorder.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Self, Unpack

import numpy as np
import pytest
from flwr.app import Message
from pydantic import Field
from torch import Tensor

from client_app.app import make_app
from client_app.base import ClientRun, GlobalHeadHook, head_arrays
from common import methods
from common.config import ConfigError, RunConfig, parse_run_config
from common.messages import HEAD
from common.records import Arrays, to_numpy
from common.sections import Section
from server_app.inprocess import FakeGrid, small_config
from server_app.results import Recorded
from strategies import make_strategy
from strategies.base import HeteroStrategy, RunSettings, Upload, run_settings
from strategies.heads import initial_head


# --------------------------------------------------------------------------- the method
class ToyHeadConfig(Section):
    """``toyhead.*``: how far the server moves towards the replies' mean."""

    server_mix: float = Field(0.5, gt=0, le=1)
    """``m`` in ``W ← (1 − m) W + m · mean(W_k)``."""


class ToyHead(HeteroStrategy):
    """toyhead: a global head moved towards the unweighted mean of the clients' heads.

    Message contract: ``train.toyhead`` carries ``{"head.weight" [C, d], "head.bias"
    [C]}``; the client installs it, trains, and replies with its head (same keys and
    shapes). Server: ``W ← (1 − m) W + m · (1/K) Σ_k W_k``, ``m = toyhead.server-mix``.
    """

    name = "toyhead"
    shares_model = True

    def __init__(self, *, server_mix: float = 0.5, **kwargs: Unpack[RunSettings]) -> None:
        super().__init__(**kwargs)
        self.server_mix = server_mix

    @classmethod
    def from_config(cls, cfg: RunConfig) -> Self:
        section = cfg.section("toyhead")
        assert isinstance(section, ToyHeadConfig)
        return cls(server_mix=section.server_mix, **run_settings(cfg))

    def init_global(self) -> Arrays:
        return initial_head(self.nodes.values(), self.seed)

    def aggregate(self, server_round: int, uploads: list[Upload]) -> Arrays | None:
        m = self.server_mix
        return {
            key: ((1 - m) * old + m * np.mean([u.arrays[key] for u in uploads], axis=0)).astype(
                old.dtype
            )
            for key, old in self.global_arrays.items()
        }


class ToyHeadHook(GlobalHeadHook):
    """toyhead's client part: install the global head (GlobalHeadHook), train with the
    shared loop, upload the trained head."""

    name = "toyhead"

    def upload(self, run: ClientRun) -> dict[str, Tensor]:
        return head_arrays(run)


TOYHEAD = methods.Method(
    "toyhead",
    strategy=ToyHead,
    hook=ToyHeadHook,
    section=ToyHeadConfig,
    uploads_parameters=True,
    keys=(HEAD,),
)


@pytest.fixture
def toyhead() -> Iterator[methods.Method]:
    methods.register(TOYHEAD)
    try:
        yield TOYHEAD
    finally:
        methods.unregister("toyhead")


# --------------------------------------------------------------------------- the tests
def test_a_registered_method_runs_two_rounds_in_process(
    tmp_path: Path, toyhead: methods.Method
) -> None:
    run_config = small_config(tmp_path, algorithm="toyhead", **{"toyhead.server-mix": 0.25})
    cfg = parse_run_config(run_config)
    grid = FakeGrid(make_app(), run_config, num_nodes=3)
    uploads: dict[int, dict[int, Arrays]] = {}  # round -> node -> uploaded arrays

    def keep(reply: Message) -> Message:  # a "fault" that changes nothing: records uploads
        server_round = int(grid.sent[-1].content["config"]["server-round"])  # type: ignore[arg-type]
        uploads.setdefault(server_round, {})[reply.metadata.src_node_id] = to_numpy(
            reply.content["arrays"]
        )
        return reply

    for nid in grid.contexts:
        grid.faults[nid] = keep
    strategy = make_strategy(cfg)
    assert isinstance(strategy, ToyHead) and strategy.server_mix == 0.25
    recorder = Recorded(strategy, cfg, cfg.resolved_out_dir("t"))
    initial = strategy.initial_arrays(grid)  # type: ignore[arg-type]
    globals_seen = [dict(strategy.global_arrays)]

    def end_round(server_round: int, arrays):  # type: ignore[no-untyped-def]
        globals_seen.append(dict(strategy.global_arrays))
        return recorder.end_round(server_round, arrays)

    recorder.start(grid, initial, num_rounds=2, evaluate_fn=end_round)  # type: ignore[arg-type]
    res = json.loads(recorder.write().read_text())

    assert [r["round"] for r in res["rounds"]] == [1, 2]
    assert res["config"]["algorithm"] == "toyhead"
    assert res["config"]["toyhead.server-mix"] == 0.25
    sent = [m.metadata.message_type for m in grid.sent]
    assert sent.count("train.toyhead") == 6
    # every node evaluated after each round (by an evaluate.toyhead message, or inside
    # the next round's training message where evaluation travels with it)
    assert [r["eval-clients"] for r in res["rounds"]] == [3, 3]
    assert all(m in ("query.profile", "train.toyhead", "evaluate.toyhead") for m in sent)
    head_bytes = sum(v.nbytes for v in globals_seen[0].values())
    assert res["rounds"][0]["bytes-up-per-client"] == head_bytes
    # round 2's global head is the rule applied to round 2's uploads, computed here
    # independently with numpy (not by the strategy's code path)
    before, after, replies = globals_seen[-2], globals_seen[-1], uploads[2]
    assert len(replies) == 3
    for key in before:
        mean = np.mean([replies[n][key].astype(np.float64) for n in replies], axis=0)
        want = 0.75 * before[key].astype(np.float64) + 0.25 * mean
        np.testing.assert_allclose(after[key], want, rtol=1e-5, atol=1e-6)
        assert not np.allclose(after[key], before[key])
    assert res["rounds"][-1]["accuracy"] > 0


def test_the_config_section_of_a_registered_method_is_validated(toyhead: methods.Method) -> None:
    cfg = parse_run_config({"algorithm": "toyhead", "toyhead.server-mix": 0.5})
    assert cfg.section("toyhead") == ToyHeadConfig(server_mix=0.5)
    with pytest.raises(ConfigError, match="toyhead.server-mix"):
        parse_run_config({"algorithm": "toyhead", "toyhead.server-mix": 2.0})


def test_an_unregistered_method_is_refused_everywhere() -> None:
    with pytest.raises(ConfigError, match="'algorithm'.*toyhead"):
        parse_run_config({"algorithm": "toyhead"})
    with pytest.raises(ConfigError, match="unknown run-config key 'toyhead.server-mix'"):
        parse_run_config({"toyhead.server-mix": 0.5})
    assert "train.toyhead" not in make_app()._registered_funcs


def test_registration_refuses_a_taken_or_unroutable_name(toyhead: methods.Method) -> None:
    with pytest.raises(ValueError, match="already registered"):
        methods.register(methods.Method("toyhead", strategy=ToyHead, hook=GlobalHeadHook))
    with pytest.raises(ValueError, match="one lower-case word"):
        methods.register(methods.Method("toy-head", strategy=ToyHead, hook=ToyHeadHook))
    with pytest.raises(ValueError, match="built in"):
        methods.unregister("fedre")


def test_strategy_constructors_mirror_their_config_sections() -> None:
    """Every built-in strategy is built with keywords a Flower user can pass; each
    keyword that is also a key of its config section has that key's default, and
    from_config passes the run config's values through."""
    for name, method in methods.METHODS.items():
        cls = method.strategy_class()
        params = inspect.signature(cls.__init__).parameters
        assert all(
            p.kind in (p.KEYWORD_ONLY, p.VAR_KEYWORD) for k, p in params.items() if k != "self"
        ), name
        if method.section is not None:
            fields = method.section.model_fields
            for key, p in params.items():
                if key in fields:
                    default = p.default
                    if isinstance(default, tuple):  # a list setting: comma-separated in config
                        default = ",".join(map(str, default))
                    assert default == fields[key].default, (name, key)
        family = "fedavgcnn" if name == "fedavg" else "cnn"
        cfg = parse_run_config(
            {"algorithm": name, "model.family": family, "seed": 7, "fraction-train": 0.5}
        )
        strategy = make_strategy(cfg)
        assert type(strategy) is cls and strategy.seed == 7 and strategy.fraction_train == 0.5


def test_a_strategy_is_usable_without_a_run_config() -> None:
    from strategies.fedara import FedARA
    from strategies.fedre import FedRE

    fedre = FedRE(server_lr=0.05, server_epochs=3, fraction_train=0.5)
    assert (fedre.server_lr, fedre.server_epochs, fedre.fraction_train) == (0.05, 3, 0.5)
    from_config = make_strategy(parse_run_config({"algorithm": "fedara", "fedara.server-lr": 2}))
    assert isinstance(from_config, FedARA) and from_config.server_lr == 2.0
    assert FedARA(server_lr=2.0).server_lr == 2.0


def test_every_upload_key_a_strategy_expects_is_a_declared_message_key() -> None:
    """A method's ``keys`` cover what its strategy sends and expects back."""
    from strategies.testing import node

    nodes = [node(10, 0, **{"rank-ratio": 1.0}), node(11, 1, **{"rank-ratio": 0.5})]
    for name, method in methods.METHODS.items():
        if not method.keys:
            continue
        s = make_strategy(parse_run_config({"algorithm": name}))
        s.nodes = {n.node_id: n for n in nodes}
        s.global_arrays = s.init_global()
        expected = s.expected_upload(nodes[0]) or {}
        for key in [*expected, *s.global_arrays]:
            assert key.startswith(method.keys), (name, key, method.keys)


@pytest.mark.slow
@pytest.mark.parametrize("name", [m.name for m in methods.BUILTIN])
def test_the_server_step_benchmark_fakes_replies_every_method_accepts(name: str) -> None:
    """benchmarks/server_step.py times every method's server on fake replies of the
    method's keys and shapes: each method takes all of them (none rejected) and
    aggregates them."""
    from benchmarks.server_step import time_method

    row = time_method(name, 3, rounds=1)
    assert row["rejected"] == [0], row
    assert row["cpu-s-per-round"] > 0
