"""Foundation strategies driven with crafted replies (expected values from numpy)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import numpy as np
import pytest

import strategies
from common.config import RunConfig, parse_run_config
from common.methods import BUILTIN, METHODS
from common.records import to_numpy
from strategies.base import HeteroStrategy
from strategies.fedavg import FedAvg
from strategies.lgfedavg import LGFedAvg
from strategies.local import Local
from strategies.testing import error_reply, node, reply, sized, strategy

RNG = np.random.default_rng(0)


def head(d: int = 500, c: int = 10) -> dict[str, np.ndarray]:
    return {
        "head.weight": RNG.normal(size=(c, d)).astype(np.float32),
        "head.bias": RNG.normal(size=(c,)).astype(np.float32),
    }


def test_registry_names_are_the_config_values() -> None:
    """One algorithm, one word: every registered name is an accepted config value, its
    strategy is defined in ``strategies/<name>.py`` and sends ``train.<name>``, its
    client hook answers to the same name, and its config section (if any) is the
    typed ``<name>`` field of the run config."""
    assert [m.name for m in BUILTIN] == list(METHODS)[: len(BUILTIN)]
    for name, method in METHODS.items():
        family = "fedavgcnn" if name == "fedavg" else "cnn"
        assert parse_run_config({"algorithm": name, "model.family": family}).algorithm == name
        cls = method.strategy_class()
        assert cls.__module__ == f"strategies.{name}", (name, cls)
        assert cls.name == name, (name, cls.name)
        assert type(method.client_hook()).name == name
        assert method.client_hook().__module__.startswith("client_app.")
        if method.section is None:
            assert name not in RunConfig.model_fields
        else:
            assert RunConfig.model_fields[name].annotation is method.section


def named_strategies() -> dict[str, type[HeteroStrategy]]:
    """Every named ``HeteroStrategy`` subclass defined in a module of ``strategies``."""
    found: dict[str, type[HeteroStrategy]] = {}
    for info in pkgutil.iter_modules(strategies.__path__):
        module = importlib.import_module(f"strategies.{info.name}")
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, HeteroStrategy) and cls.__module__ == module.__name__ and cls.name:
                found[cls.name] = cls
    return found


def test_every_strategy_in_the_package_is_registered() -> None:
    """The built-in methods are exactly the named strategies of ``strategies/``: a
    strategy file without its ``Method(...)`` (or a registration without its file) is
    caught here, whatever the number of methods."""
    found = named_strategies()
    assert set(found) == {m.name for m in BUILTIN}
    for m in BUILTIN:
        assert m.strategy_class() is found[m.name]


def test_lgfedavg_is_the_sample_weighted_mean_of_heads() -> None:
    nodes = [node(10, 0), node(11, 1), node(12, 2)]
    s = strategy(LGFedAvg, nodes)
    s.global_arrays = s.init_global()
    heads = [head(), head(), head()]
    weights = [30, 50, 20]
    sized(s, {10: 30, 11: 50, 12: 20})
    replies = [reply(n.node_id, h, w) for n, h, w in zip(nodes, heads, weights, strict=False)]
    arrays, metrics = s.aggregate_train(1, replies)
    got = to_numpy(arrays)
    for key in ("head.weight", "head.bias"):
        want = (
            sum(h[key].astype(np.float64) * w for h, w in zip(heads, weights, strict=False)) / 100
        )
        np.testing.assert_allclose(got[key], want, rtol=1e-5, atol=1e-6)
    assert metrics["valid-replies"] == 3


def test_result_does_not_depend_on_reply_order() -> None:
    nodes = [node(10 + i, i) for i in range(4)]
    s = strategy(LGFedAvg, nodes)
    s.global_arrays = s.init_global()
    heads = [head() for _ in nodes]
    sized(s, {10 + i: 10 + i for i in range(4)})
    replies = [
        reply(n.node_id, h, 10 + i) for i, (n, h) in enumerate(zip(nodes, heads, strict=False))
    ]
    a, _ = s.aggregate_train(1, replies)
    b, _ = s.aggregate_train(1, list(reversed(replies)))
    for key in a:
        np.testing.assert_array_equal(a[key].numpy(), b[key].numpy())


@pytest.mark.parametrize("poison", ["nan", "inf", "shape", "keys", "error", "examples"])
def test_poisoned_reply_is_dropped_and_logged(poison: str) -> None:
    nodes = [node(10, 0), node(11, 1), node(12, 2)]
    s = strategy(LGFedAvg, nodes)
    s.global_arrays = s.init_global()
    good = [head(), head()]
    bad = head()
    if poison == "nan":
        bad["head.weight"][3, 7] = np.nan
    elif poison == "inf":
        bad["head.bias"][0] = np.inf
    elif poison == "shape":
        bad["head.weight"] = bad["head.weight"][:, :499]
    elif poison == "keys":
        bad["extra"] = bad.pop("head.bias")
    sized(s, {10: 40, 11: 60, 12: 1000})
    replies = [reply(10, good[0], 40), reply(11, good[1], 60)]
    replies.append(
        error_reply(12)
        if poison == "error"
        else reply(12, bad, 0 if poison == "examples" else 1000)
    )
    arrays, _ = s.aggregate_train(3, replies)
    got = to_numpy(arrays)
    want = (
        good[0]["head.weight"].astype(np.float64) * 40
        + good[1]["head.weight"].astype(np.float64) * 60
    ) / 100
    np.testing.assert_allclose(got["head.weight"], want, rtol=1e-5, atol=1e-6)
    assert [(r, n) for r, n, _ in s.rejected] == [(3, 12)]


def test_too_few_valid_replies_keep_the_global_state() -> None:
    nodes = [node(10, 0), node(11, 1)]
    s = strategy(LGFedAvg, nodes, **{"min-valid-replies": 2})
    s.global_arrays = before = s.init_global()
    bad = head()
    bad["head.weight"][0, 0] = np.nan
    sized(s, {10: 5, 11: 5})
    arrays, metrics = s.aggregate_train(1, [reply(10, head(), 5), reply(11, bad, 5)])
    assert arrays is None and metrics is None
    assert s.global_arrays is before


def test_local_exchanges_nothing() -> None:
    s = sized(strategy(Local, [node(10, 0), node(11, 1)]), {10: 5, 11: 7})
    assert s.init_global() == {}
    arrays, metrics = s.aggregate_train(1, [reply(10, {}, 5), reply(11, {}, 7)])
    assert arrays is None and metrics["valid-replies"] == 2
    # An upload to a strategy that expects none is a protocol violation.
    s.aggregate_train(2, [reply(10, head(), 5)])
    assert s.rejected and s.rejected[0][1] == 10


def test_fedavg_refuses_heterogeneous_families() -> None:
    s = strategy(FedAvg, [node(10, 0, arch="cnn-1"), node(11, 1, arch="cnn-2")])
    with pytest.raises(ValueError, match="fedavg.*homogeneous.*cnn-1.*cnn-2"):
        s.init_global()


def test_fedavg_averages_whole_models() -> None:
    nodes = [node(10, 0, arch="fedavgcnn", d=512), node(11, 1, arch="fedavgcnn", d=512)]
    s = strategy(FedAvg, nodes, **{"model.family": "fedavgcnn"})
    s.global_arrays = g = s.init_global()
    assert "extractor.conv1.weight" in g and "head.weight" in g
    ups = [{k: v + i for k, v in g.items()} for i in (1, 2)]
    sized(s, {10: 1, 11: 3})
    arrays, _ = s.aggregate_train(1, [reply(10, ups[0], 1), reply(11, ups[1], 3)])
    got = to_numpy(arrays)
    for k in g:
        np.testing.assert_allclose(got[k], g[k] + 1.75, rtol=1e-5, atol=1e-5)


def test_lgfedavg_refuses_disagreeing_heads() -> None:
    s = strategy(LGFedAvg, [node(10, 0, d=500), node(11, 1, d=512)])
    with pytest.raises(ValueError, match="disagree"):
        s.init_global()


def test_superlink_error_for_a_dead_node_is_attributed_to_that_node() -> None:
    """The SuperLink answers for an unreachable node with an error *it* sends
    (src = SuperLink); the strategy must still name the node it is about."""
    from flwr.app import ConfigRecord, Error, Message
    from flwr.common.constant import SUPERLINK_NODE_ID

    nodes = [node(10, 0, num_train=5), node(11, 1)]
    s = strategy(LGFedAvg, nodes)
    s.global_arrays = s.init_global()

    class Grid:
        def get_node_ids(self) -> list[int]:
            return [10, 11]

    msgs = list(s.configure_train(1, None, ConfigRecord(), Grid()))
    for i, m in enumerate(msgs):  # what Grid.push_messages does
        m.metadata.__dict__["_message_id"] = f"id-{i}"
    dead = next(m for m in msgs if m.metadata.dst_node_id == 11)
    err = Message(Error(code=3, reason="Node Unavailable"), reply_to=dead)
    err.metadata.__dict__["_src_node_id"] = SUPERLINK_NODE_ID
    err.metadata.__dict__["_reply_to_message_id"] = dead.metadata.message_id
    s.aggregate_train(1, [reply(10, head(), 5), err])
    assert [(r, n) for r, n, _ in s.rejected] == [(1, 11)]
    assert s.missing == []


def _eval_reply(nid: int, **metrics: float):  # type: ignore[no-untyped-def]
    from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict

    sent = Message(
        RecordDict({"config": ConfigRecord()}), dst_node_id=nid, message_type="evaluate.x"
    )
    return Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=sent)


def test_evaluation_aggregates_sample_weighted_and_drops_bad_replies() -> None:
    s = strategy(LGFedAvg, [node(10, 0), node(11, 1), node(12, 2), node(13, 3)])
    good = [
        _eval_reply(10, **{"num-examples": 10, "correct": 9, "loss-sum": 1.0}),
        _eval_reply(11, **{"num-examples": 30, "correct": 15, "loss-sum": 9.0}),
    ]
    bad = [
        _eval_reply(12, **{"num-examples": 5, "correct": 7, "loss-sum": 1.0}),
        _eval_reply(13, **{"num-examples": 5, "loss-sum": 1.0}),
    ]
    m = s.aggregate_evaluate(1, good + bad)
    assert m["accuracy"] == pytest.approx(24 / 40)
    assert m["accuracy-mean"] == pytest.approx((0.9 + 0.5) / 2)
    assert m["accuracy-std"] == pytest.approx(0.2)
    assert m["loss"] == pytest.approx(10 / 40)
    assert m["eval-clients"] == 2 and "accuracy-global" not in m
    assert set(s.last_eval) == {0, 1}
