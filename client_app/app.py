"""fedhet ClientApp: ``query.profile`` plus ``train.<algo>`` / ``evaluate.<algo>``."""

from __future__ import annotations

import time
from logging import WARNING

import torch
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.mod import LocalDpMod
from flwr.clientapp.typing import Mod
from flwr.common.logger import log

from client_app.base import ClientHook, global_test, open_run, profile_record, run_config
from client_app.clock import timing_metrics
from client_app.export import keep_evaluated
from common import methods
from common.config import Scalar
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
    return dp(msg, context, call_next)


def _uploads_parameters(name: str) -> bool:
    method = methods.METHODS.get(name)
    return method is not None and method.uploads_parameters


def profile(msg: Message, context: Context) -> Message:
    """Tell the server who this node is (partition, architecture, data sizes)."""
    hook = methods.get(run_config(context).algorithm).client_hook()
    return Message(
        RecordDict({"profile": profile_record(context, hook)}),
        reply_to=msg,
    )


def _round(msg: Message) -> int:
    return int(msg.content["config"]["server-round"])  # type: ignore[arg-type]


def _clients_dir(msg: Message) -> str:
    """The simulation's folder for personal models, if the server sent one."""
    return str(msg.content["config"].get("clients-dir", ""))


def _lineage(msg: Message) -> str:
    """The run's lineage tag (names the personal model's files; kept on resume)."""
    return str(msg.content["config"].get("lineage", ""))


def _served(msg: Message) -> dict[str, Scalar]:
    """What the server decided for this node this round (FedARA's deadline policy:
    its ``rank-ratio``); overrides node-config for this message."""
    ratio = msg.content["config"].get("rank-ratio")
    return {"rank-ratio": float(ratio)} if isinstance(ratio, int | float) else {}


def handle_train(hook: ClientHook, msg: Message, context: Context) -> Message:
    """Install the server's arrays, train, upload, keep the personal model."""
    run = open_run(
        context, _round(msg), hook, _clients_dir(msg), lineage=_lineage(msg), served=_served(msg)
    )
    run.received = to_torch(msg.content.array_records["arrays"])
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
    return Message(RecordDict({"arrays": to_record(upload), "metrics": metrics}), reply_to=msg)


def handle_evaluate(hook: ClientHook, msg: Message, context: Context) -> Message:
    """Evaluate the personalized model (with what the server sent) on local test data."""
    run = open_run(
        context,
        _round(msg),
        hook,
        _clients_dir(msg),
        training=False,
        lineage=_lineage(msg),
        served=_served(msg),
    )
    run.received = to_torch(msg.content.array_records["arrays"])
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
    return Message(RecordDict({"metrics": metrics}), reply_to=msg)


def make_app(mods: list[Mod] | None = None) -> ClientApp:
    """A ClientApp that answers ``query.profile`` and, for every registered method,
    ``train.<name>`` / ``evaluate.<name>`` with that method's client hook; ``mods``
    run before fedhet's own (``parameter_dp``)."""
    client = ClientApp(mods=[*(mods or []), parameter_dp])
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
