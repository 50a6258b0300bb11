"""fedhet ServerApp: run config -> strategy -> rounds -> results.json + plot."""

from __future__ import annotations

import time
from logging import ERROR, INFO

from flwr.app import Context
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp

from common.config import ConfigError, RunConfig, parse_run_config
from common.report import Run, plot_accuracy
from server_app.grid import PollingGrid
from server_app.results import Recorded
from strategies import STRATEGIES

app = ServerApp()


def load_config(context: Context) -> RunConfig:
    """Validated run config; a bad key stops the run with one clear line."""
    try:
        return parse_run_config(context.run_config)
    except ConfigError as exc:
        log(ERROR, "fedhet: %s", exc)
        raise ConfigError(f"fedhet: {exc}") from None


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run ``num-server-rounds`` rounds of the configured algorithm."""
    grid = PollingGrid(grid)  # replies every 0.1 s (Flower's HTTP grid polls every 3 s)
    cfg = load_config(context)
    out_dir = cfg.resolved_out_dir(time.strftime("%Y%m%d-%H%M%S"))
    strategy = STRATEGIES[cfg.algorithm](cfg)
    try:
        initial = strategy.initial_arrays(grid)
    except ValueError as exc:  # e.g. fedavg on a heterogeneous family
        log(ERROR, "fedhet: %s", exc)
        raise ConfigError(f"fedhet: {exc}") from None
    recorder = Recorded(strategy, cfg, out_dir)
    log(
        INFO,
        "[fedhet] %s: %d nodes, %d rounds, results in %s",
        cfg.algorithm,
        len(strategy.nodes),
        cfg.num_server_rounds,
        out_dir,
    )
    recorder.start(
        grid=grid,
        initial_arrays=initial,
        num_rounds=cfg.num_server_rounds,
        timeout=cfg.round_timeout,
        evaluate_fn=recorder.end_round,
    )
    path = recorder.write()
    plot_accuracy([Run.load(path)], out_dir / "accuracy.png", title=cfg.algorithm)
    summary = recorder.results()["summary"]
    log(
        INFO,
        "[fedhet] done: accuracy last %s best %s (round %s); results: %s",
        _fmt(summary["accuracy-last"]),
        _fmt(summary["accuracy-best"]),
        summary["best-round"],
        path,
    )


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"
