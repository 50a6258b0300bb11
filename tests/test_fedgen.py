"""fedgen: the server's head mean and teacher against numpy (crafted replies), the
generator's training (lowers the teacher's CE, deterministic, kept and sent), the
client's generated-feature term against a closed form, label sampling, refused
counts, and two rounds in process."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from client_app.base import open_run
from client_app.fedgen import received_generator
from common import methods
from common.messages import GENERATOR, LABEL_COUNTS
from common.records import to_numpy
from models.generator import Generator, draw_labels, generator_state
from server_app.inprocess import client_context, run_inprocess
from strategies.fedgen import FedGen
from strategies.heads import BIAS, WEIGHT
from strategies.testing import node, reply, sized, strategy

COUNTS = ((30, 20, 10, 0), (0, 10, 10, 20), (5, 5, 5, 5))
"""Three nodes' training samples per class (4 classes, d = 6)."""
SMALL = {"fedgen.noise-dim": 4, "fedgen.hidden-dim": 16, "fedgen.server-iterations": 60}
HTFLLIB_LR = {"fedgen.server-lr": 0.005}


def _setup(**cfg: object) -> tuple[FedGen, list[dict[str, np.ndarray]]]:
    """A FedGen strategy that knows three nodes, its initial head sent, and one
    trained head per node (random, seeded) with that node's label counts."""
    nodes = [
        node(10 + i, i, d=6, classes=4, num_train=sum(c), counts=c) for i, c in enumerate(COUNTS)
    ]
    s = strategy(FedGen, nodes, **{**SMALL, **cfg})
    assert isinstance(s, FedGen)
    s.global_arrays = s.init_global()
    s.awaiting = {10, 11, 12}
    rng = np.random.default_rng(0)
    uploads = [
        {
            WEIGHT: rng.normal(size=(4, 6)).astype(np.float32),
            BIAS: rng.normal(size=4).astype(np.float32),
            LABEL_COUNTS: np.asarray(c, np.float32),
        }
        for c in COUNTS
    ]
    return s, uploads


def _replies(uploads: list[dict[str, np.ndarray]]) -> list:
    return [reply(10 + i, u, sum(COUNTS[i])) for i, u in enumerate(uploads)]


def _ensemble_ce(gen: Generator, uploads: list[dict[str, np.ndarray]], seed: int) -> float:
    """The teacher's CE computed head by head in numpy: logits of z with label y are
    Σ_k α_k^y (W_k z + b_k), α_k^y = n_k^y / Σ_j n_j^y; labels by the pooled counts."""
    counts = np.array(COUNTS, np.float64)
    alpha = counts / counts.sum(0)
    g = torch.Generator().manual_seed(seed)
    labels = draw_labels(torch.from_numpy(counts.sum(0)), 512, g)
    with torch.no_grad():
        _, z = gen.eval().sample(labels, g)
    z64, y = z.numpy().astype(np.float64), labels.numpy()
    logits = sum(
        alpha[k, y][:, None] * (z64 @ u[WEIGHT].T.astype(np.float64) + u[BIAS])
        for k, u in enumerate(uploads)
    )
    top = logits.max(1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(1, keepdims=True))
    return float(-logp[np.arange(len(y)), y].mean())


def _generator(arrays: dict[str, np.ndarray], noise: int = 4, hidden: int = 16) -> Generator:
    gen = Generator(noise, 4, hidden, 6)
    state = {
        k.removeprefix(GENERATOR): torch.from_numpy(v)
        for k, v in arrays.items()
        if k.startswith(GENERATOR)
    }
    gen.load_state_dict(state, strict=False)
    return gen


def test_the_global_head_is_the_sample_weighted_mean_of_the_uploaded_heads() -> None:
    s, uploads = _setup()
    arrays, metrics = s.aggregate_train(1, _replies(uploads))
    assert arrays is not None and metrics is not None and metrics["valid-replies"] == 3
    got = to_numpy(arrays)
    n = np.array([sum(c) for c in COUNTS], np.float64)
    for key in (WEIGHT, BIAS):
        want = sum(n[k] / n.sum() * uploads[k][key].astype(np.float64) for k in range(3))
        np.testing.assert_allclose(got[key], want, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(got[LABEL_COUNTS], np.sum(COUNTS, 0))  # pooled, sent on
    assert {k for k in got if k.startswith(GENERATOR)} == {
        GENERATOR + k for k in generator_state(Generator(4, 4, 16, 6))
    }


def test_robust_aggregate_median_applies_to_the_head() -> None:
    s, uploads = _setup(**{"robust.aggregate": "median"})
    equal = [dict(u, **{LABEL_COUNTS: np.asarray((15, 15, 10, 0), np.float32)}) for u in uploads]
    sized(s, {10: 40, 11: 40, 12: 40})
    arrays, _ = s.aggregate_train(1, [reply(10 + i, u, 40) for i, u in enumerate(equal)])
    assert arrays is not None
    got = to_numpy(arrays)
    np.testing.assert_array_equal(got[WEIGHT], np.median([u[WEIGHT] for u in equal], axis=0))


def test_the_teacher_combines_the_uploaded_heads_per_label_by_label_share() -> None:
    """Per label y: Σ_k α_k^y W_k and Σ_k α_k^y b_k with α_k^y = n_k^y / Σ_j n_j^y
    (not the sample shares)."""
    s, uploads = _setup()
    weights, biases, pooled = s.teacher(s.valid_uploads(1, _replies(uploads)))
    counts = np.array(COUNTS, np.float64)
    np.testing.assert_array_equal(pooled, counts.sum(0))
    for y in range(4):
        alpha = counts[:, y] / counts[:, y].sum()
        want_w = sum(alpha[k] * uploads[k][WEIGHT].astype(np.float64) for k in range(3))
        want_b = sum(alpha[k] * uploads[k][BIAS].astype(np.float64) for k in range(3))
        np.testing.assert_allclose(weights[y].numpy(), want_w, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(biases[y].numpy(), want_b, rtol=1e-5, atol=1e-6)


def test_the_size_screen_measures_the_head_update_only() -> None:
    """robust.max-norm-ratio sees ‖head − sent head‖, never the label counts (which
    differ from the pooled counts the server sent by design)."""
    s, _ = _setup()
    s.aggregate_train(1, _replies(_setup()[1]))  # now the global holds pooled counts
    sent = {k: v.copy() for k, v in s.global_arrays.items()}
    rng = np.random.default_rng(3)
    steps = (0.1, 0.2, 0.4)
    uploads = [
        {
            WEIGHT: sent[WEIGHT] + rng.normal(0, step, (4, 6)).astype(np.float32),
            BIAS: sent[BIAS] + rng.normal(0, step, 4).astype(np.float32),
            LABEL_COUNTS: np.asarray(c, np.float32),
        }
        for step, c in zip(steps, COUNTS, strict=True)
    ]
    s.awaiting = {10, 11, 12}
    s.aggregate_train(2, _replies(uploads))
    norms = [
        float(
            np.sqrt(sum(((u[k] - sent[k]).astype(np.float64) ** 2).sum() for k in (WEIGHT, BIAS)))
        )
        for u in uploads
    ]
    want = {str(i): n / float(np.median(norms)) for i, n in enumerate(norms)}
    assert s.size_ratios == pytest.approx(want, rel=1e-5)


def test_the_generator_training_lowers_the_ensemble_ce_and_is_deterministic() -> None:
    """(At HtFLlib's learning rate: the default's 3e-4 moves the tiny generator little in
    60 steps; a mechanism test.)"""
    s, uploads = _setup(**HTFLLIB_LR)
    initial = s.initial_generator(s.nodes[10])
    arrays, _ = s.aggregate_train(1, _replies(uploads))
    assert arrays is not None
    trained = _generator(to_numpy(arrays))
    # the teacher, head by head in numpy, on fresh draws: training lowered its CE
    before, after = _ensemble_ce(initial, uploads, 7), _ensemble_ce(trained, uploads, 7)
    assert after < 0.8 * before, (before, after)
    diag = s.diagnostics
    assert diag["generator-ce-after"] < diag["generator-ce-before"]
    # the same seed and round: the same generator, bit for bit
    again, _ = _setup(**HTFLLIB_LR)[0].aggregate_train(1, _replies(uploads))
    assert again is not None
    for key, value in to_numpy(arrays).items():
        np.testing.assert_array_equal(to_numpy(again)[key], value)
    # another round draws other labels and noise
    other, _ = _setup(**HTFLLIB_LR)
    other_arrays, _ = other.aggregate_train(2, _replies(uploads))
    assert other_arrays is not None
    assert not np.array_equal(
        to_numpy(other_arrays)[GENERATOR + "out.weight"], to_numpy(arrays)[GENERATOR + "out.weight"]
    )


def test_the_trained_generator_is_kept_sent_and_trained_further() -> None:
    s, uploads = _setup()
    initial = generator_state(s.initial_generator(s.nodes[10]))
    arrays, _ = s.aggregate_train(1, _replies(uploads))
    assert arrays is not None
    sent = s.payload(2, s.nodes[10])
    round1 = {k: v.copy() for k, v in sent.items() if k.startswith(GENERATOR)}
    assert round1 and not np.array_equal(
        round1[GENERATOR + "out.weight"], initial["out.weight"].numpy()
    )
    # round 2 starts from round 1's generator (the kept one), not from the initial one
    assert s.current_generator(s.nodes[10]).out.weight.detach().numpy().tobytes() == (
        round1[GENERATOR + "out.weight"].tobytes()
    )
    s.awaiting = {10, 11, 12}
    s.aggregate_train(2, _replies(uploads))
    fresh, _ = _setup()
    fresh_arrays, _ = fresh.aggregate_train(2, _replies(uploads))  # round 2 from the initial
    assert fresh_arrays is not None
    assert not np.array_equal(
        s.global_arrays[GENERATOR + "out.weight"], to_numpy(fresh_arrays)[GENERATOR + "out.weight"]
    )


@pytest.mark.parametrize(
    ("counts", "why"),
    [
        ((30, 20, 10, -0), None),
        ((40, 20, 10, -10), "negative"),
        ((30.5, 19.5, 10, 0), "whole"),
        ((30, 20, 10, 1), "sum to 61"),
        ((30, 20, 10), "wrong shape"),
        ((30, 20, np.nan, 0), "non-finite"),
    ],
)
def test_a_reply_with_bad_label_counts_is_refused(counts: tuple, why: str | None) -> None:
    s, uploads = _setup(**{"min-valid-replies": 1})
    s.awaiting = {10}
    bad = dict(uploads[0], **{LABEL_COUNTS: np.asarray(counts, np.float32)})
    arrays, _ = s.aggregate_train(1, [reply(10, bad, 60)])
    if why is None:
        assert arrays is not None and not s.rejected
    else:
        assert arrays is None
        assert [nid for _, nid, _ in s.rejected] == [10]
        assert why in s.rejected[0][2]


def test_labels_are_drawn_by_the_pooled_counts() -> None:
    counts = torch.tensor([0.0, 10.0, 30.0, 0.0, 60.0])
    labels = draw_labels(counts, 20_000, torch.Generator().manual_seed(0))
    freq = torch.bincount(labels, minlength=5).double() / len(labels)
    assert freq[0] == 0 and freq[3] == 0
    np.testing.assert_allclose(freq.numpy(), [0, 0.1, 0.3, 0, 0.6], atol=0.01)


def _client(tmp_path: Path, weight: float, label: int = 2):
    """A fedgen client (partition 0) sent a generator whose output is one fixed vector
    f (output weights zero, bias f) and pooled counts on class ``label`` only."""
    hook = methods.get("fedgen").client_hook()
    ctx = client_context(tmp_path, "fedgen", pid=0, **{"fedgen.weight": weight})
    run = open_run(ctx, 2, hook)
    c, d = run.data.num_classes, run.model.feature_dim
    gen = Generator(3, c, 8, d)
    f = torch.linspace(-1, 1, d)
    with torch.no_grad():
        gen.out.weight.zero_()
        gen.out.bias.copy_(f)
    counts = torch.zeros(c)
    counts[label] = 7
    received = {GENERATOR + k: v for k, v in generator_state(gen).items()}
    received[LABEL_COUNTS] = counts
    run.received = received
    hook.install(run, received)
    return hook, run, f


def test_the_client_term_is_weight_times_the_heads_ce_on_generated_features(
    tmp_path: Path,
) -> None:
    hook, run, f = _client(tmp_path, 0.5)
    loss = hook.extra_loss(run)
    assert loss is not None
    w, b = run.model.head.weight.detach().double(), run.model.head.bias.detach().double()
    z = w @ f.double() + b
    closed = 0.5 * float(torch.logsumexp(z, 0) - z[2])  # every drawn label is 2
    b_size = 5
    got = loss(
        torch.zeros(b_size, 1),
        torch.zeros(b_size, 1),
        torch.zeros(b_size, dtype=torch.long),
        torch.zeros(b_size),
    )
    assert float(got.detach()) == pytest.approx(closed, rel=1e-5)
    got.backward()  # the term trains the head
    assert (
        run.model.head.weight.grad is not None and float(run.model.head.weight.grad.abs().sum()) > 0
    )
    hook.upload(run)
    assert run.metrics["generated-ce"] == pytest.approx(closed / 0.5, rel=1e-5)


def test_no_term_with_weight_zero_or_before_a_generator_exists(tmp_path: Path) -> None:
    hook, run, _ = _client(tmp_path / "a", 0.0)
    assert hook.extra_loss(run) is None
    hook, run, _ = _client(tmp_path / "b", 1.0)
    run.received = {}  # round 1: the head only
    assert received_generator(run) is None and hook.extra_loss(run) is None


def test_the_client_refuses_a_malformed_generator(tmp_path: Path) -> None:
    hook, run, _ = _client(tmp_path, 1.0)
    sent = dict(run.received)
    for bad in (
        {k: v for k, v in sent.items() if k != LABEL_COUNTS},
        {**sent, LABEL_COUNTS: -sent[LABEL_COUNTS]},
        {**sent, GENERATOR + "out.weight": torch.zeros(3, 8)},
        {**sent, "proto.0": torch.zeros(3)},
    ):
        run.received = bad
        with pytest.raises(ValueError):
            hook.install(run, bad)


def test_the_upload_is_the_trained_head_and_the_label_counts(tmp_path: Path) -> None:
    hook, run, _ = _client(tmp_path, 1.0)
    up = hook.upload(run)
    assert torch.equal(
        up[LABEL_COUNTS], torch.bincount(run.data.y_train, minlength=run.data.num_classes).float()
    )
    assert torch.equal(up[WEIGHT], run.model.head.weight.detach())


@pytest.mark.slow  # a whole in-process run (full tier)
def test_two_rounds_in_process_send_the_trained_generator(tmp_path: Path) -> None:
    res, grid = run_inprocess(tmp_path, algorithm="fedgen", **{"num-server-rounds": 3})
    rounds = res["rounds"]
    assert [r["round"] for r in rounds] == [1, 2, 3]
    assert all("generated-ce" not in m for m in rounds[0]["client-train"].values())
    for row in rounds[1:]:
        assert sorted(row["client-train"]) == ["0", "1", "2"]
        assert all(m["generated-ce"] > 0 for m in row["client-train"].values())
    for row in rounds:
        diag = row["server-diagnostics"]
        assert diag["generator-ce-after"] < diag["generator-ce-before"]
    trains = [m for m in grid.sent if m.metadata.message_type == "train.fedgen"]
    by_round: dict[int, dict[str, np.ndarray]] = {}
    for m in trains:
        by_round.setdefault(int(m.content["config"]["server-round"]), to_numpy(m.content["arrays"]))  # type: ignore[arg-type]
    assert not any(k.startswith(GENERATOR) for k in by_round[1])
    g2, g3 = by_round[2][GENERATOR + "out.weight"], by_round[3][GENERATOR + "out.weight"]
    assert not np.array_equal(g2, g3)  # trained again in round 2, from round 1's
    assert rounds[-1]["accuracy"] > 0
