"""A node's data and model, checked before it trains; what does not fit, as one line.

Used twice: the ClientApp's ``query.profile`` answers a node whose data or model fails
with an error reply carrying :func:`unfit_reason` (the ServerApp logs it per node and
stops with the causes when no node can run), and ``fedhet simulate`` opens the first
partitions as nodes before Flower starts (:func:`check_partitions`), so a data set that
does not fit the model family stops the run at once, not 20 s later inside Ray.
"""

from __future__ import annotations

from flwr.app import Context, RecordDict

from common.config import ConfigError, RunConfig, flatten

MIN_SIDE = 16
"""The smallest image side every model family's stem takes (two 5x5 convolutions
with 2x2 pooling: ``models/nets.py``)."""


class NodeUnfit(Exception):
    """A node cannot run with its data and model; the message is one line."""


def unfit_reason(exc: BaseException) -> str:
    """One line: what does not fit (``data: ...`` or ``model: ...``) and the way out."""
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    if isinstance(exc, NodeUnfit):
        return text
    if isinstance(exc, ConfigError):
        return f"data: {text}"
    if "too small" in text and "image_size" in text:
        return (
            f"model: {text} (the model families take images of at least {MIN_SIDE} px: "
            f"set data.image-size to {MIN_SIDE} or more, or 0 to resize small images "
            "automatically)"
        )
    if "takes feature vectors" in text or "takes images" in text:
        return f"model: {text}"
    if isinstance(exc, (ValueError, KeyError, OSError)):
        return f"data or model: {type(exc).__name__}: {text}"
    return f"{type(exc).__name__}: {text}"


def check_partitions(cfg: RunConfig, num_partitions: int, count: int = 5) -> None:
    """Open the first ``count`` partitions as nodes would (data, architecture, model,
    the method's client hook); :class:`NodeUnfit` names the first that fails."""
    from client_app.base import open_run
    from common import methods

    hook = methods.get(cfg.algorithm).client_hook()
    for pid in range(min(num_partitions, count)):
        context = Context(
            run_id=0,
            node_id=pid,
            node_config={"partition-id": pid, "num-partitions": num_partitions},
            state=RecordDict(),
            run_config=flatten(cfg),
        )
        try:
            open_run(context, 0, hook)
        except Exception as exc:  # noqa: BLE001 - any failure: its one line
            raise NodeUnfit(f"partition {pid}: {unfit_reason(exc)}") from exc
