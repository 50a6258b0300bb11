"""fedhet ClientApp: ``query.profile`` plus ``train.<algo>`` / ``evaluate.<algo>``."""

from __future__ import annotations

import time
from logging import ERROR, WARNING
from typing import Any

import torch
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Error,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp import ClientApp
from flwr.clientapp.mod import LocalDpMod
from flwr.clientapp.typing import Mod
from flwr.common.constant import ErrorCode
from flwr.common.logger import log

from client_app.base import ClientHook, global_test, open_run, profile_record, run_config
from client_app.clock import timing_metrics
from client_app.export import keep_evaluated
from client_app.preflight import unfit_reason
from common import methods
from common.config import Scalar
from common.messages import EVAL_ARRAYS, EVAL_CONFIG, EVAL_METRICS
from common.packing import PackingError, is_packed, pack, unpack
from common.records import to_record, to_torch
from models.workload import host_speed


def non_finite(state: dict[str, torch.Tensor]) -> str | None:
    """The first floating-point entry of ``state`` with a NaN or an infinity, if any."""
    for key, value in state.items():
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            return key
    return None


def parameter_dp(msg: Message, context: Context, call_next):  # type: ignore[no-untyped-def]
    """``privacy.dp-clip`` > 0: Flower's own LocalDpMod on parameter uploads (the
    update clipped to that norm, Gaussian noise for (dp-epsilon, dp-delta), sensitivity
    = the clipping norm); otherwise, and for every other message, nothing."""
    p = run_config(context).privacy
    kind = msg.metadata.message_type.split(".")
    if p.dp_clip <= 0 or kind[0] != "train" or not _uploads_parameters(kind[-1]):
        return call_next(msg, context)
    dp = LocalDpMod(
        clipping_norm=p.dp_clip, sensitivity=p.dp_clip, epsilon=p.dp_epsilon, delta=p.dp_delta
    )
    # LocalDpMod wants one ArrayRecord (what training starts from); the arrays an
    # evaluation inside the message needs are handed past it
    extra = msg.content.array_records.get(EVAL_ARRAYS)
    if extra is None:
        return dp(msg, context, call_next)
    del msg.content[EVAL_ARRAYS]

    def with_extra(inner: Message, ctx: Context) -> Message:
        inner.content.array_records[EVAL_ARRAYS] = extra
        return call_next(inner, ctx)

    return dp(msg, context, with_extra)


def _uploads_parameters(name: str) -> bool:
    method = methods.METHODS.get(name)
    return method is not None and method.uploads_parameters


def profile(msg: Message, context: Context) -> Message:
    """Tell the server who this node is (partition, architecture, data sizes); a node
    whose data or model does not fit answers with an error reply whose reason is one
    line (``partition <i>: data: ...``), logged here too."""
    hook = methods.get(run_config(context).algorithm).client_hook()
    try:
        record = profile_record(context, hook)
    except Exception as exc:  # noqa: BLE001 - the server gets the cause, not a traceback
        reason = f"partition {context.node_config.get('partition-id', '?')}: {unfit_reason(exc)}"
        log(ERROR, "fedhet: %s", reason)
        return Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason), reply_to=msg)
    return Message(RecordDict({"profile": record}), reply_to=msg)


def _round(config: ConfigRecord) -> int:
    return int(config["server-round"])  # type: ignore[arg-type]


def _clients_dir(config: ConfigRecord) -> str:
    """The simulation's folder for personal models, if the server sent one."""
    return str(config.get("clients-dir", ""))


def _lineage(config: ConfigRecord) -> str:
    """The run's lineage tag (names the personal model's files; kept on resume)."""
    return str(config.get("lineage", ""))


def _served(config: ConfigRecord) -> dict[str, Scalar]:
    """What the server decided for this node this round (FedARA's deadline policy:
    its ``rank-ratio``); overrides node-config for this message."""
    ratio = config.get("rank-ratio")
    return {"rank-ratio": float(ratio)} if isinstance(ratio, int | float) else {}


def handle_train(hook: ClientHook, msg: Message, context: Context) -> Message:
    """Install the server's arrays, train, upload, keep the personal model.

    A message that also carries the previous round's evaluation (``eval-mode =
    with-train``: :data:`~common.messages.EVAL_CONFIG`) is evaluated first, exactly
    as that round's ``evaluate`` message would have been, and the reply carries its
    metrics as :data:`~common.messages.EVAL_METRICS`."""
    content = msg.content
    evaluated = None
    eval_s = eval_cpu_s = 0.0
    if EVAL_CONFIG in content.config_records:
        t0, c0 = time.perf_counter(), time.process_time()
        arrays = content.array_records.get(EVAL_ARRAYS, content.array_records["arrays"])
        evaluated = evaluation(hook, context, content.config_records[EVAL_CONFIG], arrays)
        eval_s, eval_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    reply = train(hook, content.config_records["config"], content.array_records["arrays"], context)
    if evaluated is not None:
        reply.metric_records["metrics"]["eval-time-s"] = eval_s
        reply.metric_records["metrics"]["eval-cpu-s"] = eval_cpu_s
        reply.metric_records[EVAL_METRICS] = evaluated
    return Message(reply, reply_to=msg)


def train(
    hook: ClientHook, config: ConfigRecord, arrays: ArrayRecord, context: Context
) -> RecordDict:
    """One round's training from the server's ``arrays``: the reply's records."""
    run = open_run(
        context,
        _round(config),
        hook,
        _clients_dir(config),
        lineage=_lineage(config),
        served=_served(config),
    )
    run.received = to_torch(arrays)
    device = run.node.device  # the virtual clock (fleet, device profiles)
    # read (or measured, once per machine) before the timed part
    speed = host_speed(torch.get_num_threads()) if device is not None else 0.0
    cpu_start = time.process_time()
    hook.install(run, run.received)
    stats = hook.train(run)
    upload = hook.upload(run)
    cpu_s = time.process_time() - cpu_start
    if device is not None:
        run.metrics.update(timing_metrics(cpu_s, device, speed))
    if stats.backoffs:
        log(
            WARNING,
            "partition %d, round %d: local training went non-finite; %s at the learning "
            "rate halved %d time(s)",
            run.node.partition_id,
            run.server_round,
            "stopped at the last finite epoch" if stats.gave_up else "the epoch was redone",
            stats.backoffs,
        )
    bad = non_finite(run.model.state_dict())
    if bad is None:
        run.save()
    else:
        # Training diverged: keep the personal model of the last good round (the next
        # round starts from it again) and reply as usual; the server rejects the
        # non-finite upload and logs it.
        log(
            WARNING,
            "partition %d, round %d: training produced non-finite values in '%s'; the "
            "personal model of the last good round is kept",
            run.node.partition_id,
            run.server_round,
            bad,
        )
    metrics = MetricRecord(
        {
            "num-examples": len(run.data.y_train),
            "train-loss": stats.loss,
            "train-time-s": stats.seconds,
            "rounds-trained": run.rounds_trained,
            "diverged": float(bad is not None),
            "lr-backoffs": stats.backoffs,
            "gave-up": float(stats.gave_up),
            **run.metrics,
        }
    )
    return RecordDict({"arrays": to_record(upload), "metrics": metrics})


def handle_evaluate(hook: ClientHook, msg: Message, context: Context) -> Message:
    """Evaluate the personalized model (with what the server sent) on local test data."""
    content = msg.content
    metrics = evaluation(
        hook, context, content.config_records["config"], content.array_records["arrays"]
    )
    return Message(RecordDict({"metrics": metrics}), reply_to=msg)


def evaluation(
    hook: ClientHook, context: Context, config: ConfigRecord, arrays: ArrayRecord
) -> MetricRecord:
    """The personalized model of round ``config["server-round"]`` with ``arrays``
    installed, on the local test split (and the official test set when the run uses
    it): the metrics of an evaluation reply."""
    run = open_run(
        context,
        _round(config),
        hook,
        _clients_dir(config),
        training=False,
        lineage=_lineage(config),
        served=_served(config),
    )
    run.received = to_torch(arrays)
    hook.install(run, run.received)
    stats = hook.evaluate(run, run.data.x_test, run.data.y_test)
    metrics = MetricRecord(
        {
            "num-examples": stats.num_examples,
            "correct": stats.correct,
            "loss-sum": stats.loss_sum,
            "accuracy": stats.accuracy,
        }
    )
    without = hook.evaluate_without_shared(run, run.data.x_test, run.data.y_test)
    if without is not None:
        metrics["correct-without-shared"] = without.correct
    for key, value in run.metrics.items():
        metrics[key] = value
    official = global_test(run)
    if official is not None:
        g = hook.evaluate(run, *official)
        metrics["global-correct"] = g.correct
        metrics["global-num-examples"] = g.num_examples
    keep_evaluated(hook, run, context.run_id, stats.accuracy)  # fedhet export, onnx-export
    return metrics


def packing(msg: Message, context: Context, call_next: Any) -> Message:
    """A message that came packed (``pack-messages``, deployment) is unpacked for the
    node, and its reply goes back packed; anything else passes as it is."""
    if not msg.has_content() or not is_packed(msg.content):
        return call_next(msg, context)  # type: ignore[no-any-return]
    try:
        msg.content = unpack(msg.content)
    except PackingError as exc:
        log(ERROR, "fedhet: a message does not unpack: %s", exc)
        return Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, f"unpack: {exc}"), reply_to=msg)
    reply: Message = call_next(msg, context)
    if reply.has_content():
        reply.content = pack(reply.content)
    return reply


def make_app(mods: list[Mod] | None = None) -> ClientApp:
    """A ClientApp that answers ``query.profile`` and, for every registered method,
    ``train.<name>`` / ``evaluate.<name>`` with that method's client hook; ``mods``
    run before fedhet's own (``parameter_dp``)."""
    client = ClientApp(mods=[packing, *(mods or []), parameter_dp])
    client.query("profile")(profile)
    for method in methods.METHODS.values():
        _route(client, method.name)
    return client


def _route(client: ClientApp, name: str) -> None:
    def train(msg: Message, context: Context) -> Message:
        return handle_train(methods.get(name).client_hook(), msg, context)

    def evaluate(msg: Message, context: Context) -> Message:
        return handle_evaluate(methods.get(name).client_hook(), msg, context)

    client.train(name)(train)
    client.evaluate(name)(evaluate)


app = make_app()
