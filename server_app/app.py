"""fedhet ServerApp: run config -> strategy -> rounds -> results.json + plot."""

from __future__ import annotations

import time
from logging import ERROR, INFO
from pathlib import Path

import torch
from flwr.app import Context
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp

from common import heap
from common.config import ConfigError, RunConfig, parse_run_config
from common.records import to_record
from common.report import Run, plot_accuracy
from server_app import checkpoint
from server_app.grid import PollingGrid
from server_app.results import Recorded
from strategies import make_strategy

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
    simulation = is_simulation(grid)
    cfg = load_config(context)
    if not simulation:  # a deployed ServerApp frees a round's replies: give the pages back
        heap.start_trimmer()
    # replies polled when due (Flower's HTTP grid polls every 3 s)
    packed = cfg.pack_messages and not simulation  # nothing crosses a network in simulation
    serve(PollingGrid(grid, mode=cfg.reply_poll, pack=packed), cfg, simulation)


def serve(grid: Grid, cfg: RunConfig, simulation: bool) -> Path:
    """The rounds of one run (a new one, or ``resume``'s continued) on ``grid``;
    returns the results.json path. ``simulation``: the clients share this machine's
    file system, so their personal models go to ``<out-dir>/clients`` by round."""
    saved = None
    if cfg.resume:  # continue that run, in its folder
        out_dir = Path(cfg.resume).expanduser().resolve()
        try:
            saved = checkpoint.read(out_dir)
            checkpoint.check_config(saved["config"], cfg)
        except ConfigError as exc:
            log(ERROR, "fedhet: %s", exc)
            raise ConfigError(f"fedhet: {exc}") from None
    else:
        out_dir = cfg.resolved_out_dir(time.strftime("%Y%m%d-%H%M%S"))
    if cfg.server_threads:
        torch.set_num_threads(cfg.server_threads)
    strategy = make_strategy(cfg)
    timeout = phase_timeout(cfg, simulation)
    strategy.virtual_deadline = simulation
    if simulation:
        strategy.clients_dir = str(out_dir / "clients")
    try:
        initial = strategy.initial_arrays(grid)
    except ValueError as exc:  # e.g. fedavg on a heterogeneous family
        log(ERROR, "fedhet: %s", exc)
        raise ConfigError(f"fedhet: {exc}") from None
    recorder = Recorded(strategy, cfg, out_dir)
    if saved is not None:
        recorder.resume_from(saved)
        initial = to_record(strategy.global_arrays)
    log(
        INFO,
        "[fedhet] %s: %d nodes, %d rounds%s, results in %s",
        cfg.algorithm,
        len(strategy.nodes),
        cfg.num_server_rounds,
        f" (resumed after round {recorder.offset})" if saved is not None else "",
        out_dir,
    )
    recorder.finish_pending(grid, timeout)
    recorder.start(
        grid=grid,
        initial_arrays=initial,
        num_rounds=max(0, cfg.num_server_rounds - recorder.offset),
        timeout=timeout,
        evaluate_fn=recorder.end_round,
    )
    path = recorder.write()
    run = Run.load(path)
    plot_accuracy([run], out_dir / "accuracy.png", title=cfg.algorithm)
    if run.timed:
        plot_accuracy([run], out_dir / "accuracy-virtual.png", title=cfg.algorithm, virtual=True)
    summary = recorder.results()["summary"]
    log(
        INFO,
        "[fedhet] done: accuracy last %s best %s (round %s); results: %s",
        _fmt(summary["accuracy-last"]),
        _fmt(summary["accuracy-best"]),
        summary["best-round"],
        path,
    )
    return path


def phase_timeout(cfg: RunConfig, simulation: bool) -> float:
    """Seconds a round's phase waits for replies: ``round-timeout``, and in a real
    federation at most ``round-deadline-s`` (there the deadline is a timeout; in
    simulation it is applied to the virtual clock instead)."""
    if simulation or cfg.round_deadline_s <= 0:
        return cfg.round_timeout
    return min(cfg.round_timeout, cfg.round_deadline_s)


def is_simulation(grid: Grid) -> bool:
    """Whether the ServerApp runs in Flower's simulation (its in-memory grid): the
    clients then share this machine's file system."""
    try:
        from flwr.superlink.grid.inmemory_grid import InMemoryGrid
    except ImportError:  # a Flower that moved it: keep personal models in memory
        return False
    return isinstance(grid, InMemoryGrid)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"
