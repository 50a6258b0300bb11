"""``fedhet`` command line: simulate, partition, report."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import tomllib
import typer

from cli.pacing import DUE_SHARE, FAST_GROWTH, IDLE_POLL_S, LEAD
from cli.supernode import (
    FLOWER_IDLE_PULL_S,
    FLOWER_REPLY_WAIT_S,
    STOP_CHECK_S,
    SUPERNODE_POLL_S,
    TASK_HOLD_S,
)
from common.config import ConfigError, Scalar, flatten, parse_run_config

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    # help texts are markdown: a docstring's line breaks do not show, a blank line
    # starts a paragraph; a command's first paragraph is its line in `fedhet --help`
    rich_markup_mode="markdown",
    help="fedhet: model-heterogeneous personalized federated learning on Flower.",
)

APP_DIR = Path(__file__).resolve().parent.parent


def parse_overrides(pairs: list[str]) -> dict[str, Scalar]:
    """``["data.alpha=0.5", "algorithm='fedre'"]`` -> typed values (TOML syntax)."""
    out: dict[str, Scalar] = {}
    for pair in pairs:
        for item in pair.split():
            key, eq, raw = item.partition("=")
            if not eq:
                raise typer.BadParameter(f"'{item}' is not key=value")
            try:
                out[key] = tomllib.loads(f"v = {raw}")["v"]
            except tomllib.TOMLDecodeError:
                out[key] = raw.strip("'\"")
    return out


def _defaults() -> dict[str, Scalar]:
    doc = tomllib.loads((APP_DIR / "pyproject.toml").read_text())
    return dict(_flat_toml(doc["tool"]["flwr"]["app"]["config"]))


def _flat_toml(table: dict, prefix: str = ""):  # type: ignore[no-untyped-def]
    for key, value in table.items():
        if isinstance(value, dict):
            yield from _flat_toml(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def config_from(pairs: list[str]):  # type: ignore[no-untyped-def]
    """pyproject defaults + overrides, validated (exit 2 with one line on error)."""
    overrides = parse_overrides(pairs)
    try:
        return parse_run_config({**_defaults(), **overrides}), overrides
    except ConfigError as exc:
        typer.echo(f"fedhet: {exc}", err=True)
        raise typer.Exit(2) from None


RunConfigOpt = Annotated[
    list[str],
    typer.Option(
        "--run-config",
        "-c",
        help="key=value overrides, as for `flwr run --run-config`.",
    ),
]


ResumeOpt = Annotated[
    Path | None,
    typer.Option(
        help="Continue the run whose out-dir this is, from its last complete round, with "
        "its run config (-c may change num-server-rounds and round-timeout)."
    ),
]


def resumed_overrides(resume: Path | None, run_config: list[str]) -> tuple[dict, int | None]:
    """The overrides of a run to continue: its saved config, then ``-c``, and
    ``resume``; with the number of nodes it had (None: not resuming)."""
    if resume is None:
        return config_from(run_config)[1], None
    import json

    try:
        doc = json.loads((resume.expanduser() / "results.json").read_text())
    except (OSError, ValueError) as exc:
        typer.echo(f"fedhet: --resume {resume}: no readable results.json ({exc})", err=True)
        raise typer.Exit(2) from None
    saved = {k: v for k, v in doc["config"].items() if k not in ("out-dir", "resume")}
    overrides = {
        **saved,
        **parse_overrides(run_config),
        "resume": str(resume.expanduser().resolve()),
    }
    try:
        parse_run_config({**_defaults(), **overrides})
    except ConfigError as exc:
        typer.echo(f"fedhet: {exc}", err=True)
        raise typer.Exit(2) from None
    return overrides, len(doc["summary"].get("nodes", {})) or None


@app.command()
def simulate(
    run_config: RunConfigOpt = [],  # noqa: B006
    num_supernodes: Annotated[
        int | None,
        typer.Option(
            "--num-supernodes",
            "--nodes",
            help="Simulated clients (default 20; resuming: the run's).",
        ),
    ] = None,
    cpus_per_client: Annotated[int, typer.Option(help="Ray CPUs per ClientApp.")] = 1,
    resume: ResumeOpt = None,
    verbose: Annotated[bool, typer.Option(help="Print all Flower logs.")] = False,
) -> None:
    """Run the app as a local simulation (`flwr run .` on a SuperLink of its own).

    Prints one line per round and exits 1 unless the run finished as completed."""
    from cli.launch import run_simulation
    from client_app.preflight import NodeUnfit, check_partitions

    overrides, nodes = resumed_overrides(resume, run_config)
    try:
        cfg = parse_run_config({**_defaults(), **overrides})
        check_partitions(cfg, num_supernodes or nodes or 20)
    except (ConfigError, NodeUnfit) as exc:
        typer.echo(f"fedhet: {exc}", err=True)  # before Flower starts: nothing trained
        raise typer.Exit(2) from None

    def echo(line: str) -> None:
        if verbose or "[fedhet]" in line or "fedhet:" in line or "ERROR" in line:
            typer.echo(line)

    outcome = run_simulation(
        APP_DIR,
        overrides,
        num_supernodes=num_supernodes or nodes or 20,
        cpus_per_client=cpus_per_client,
        echo=echo,
    )
    typer.echo(f"run {outcome.run_id}: {outcome.status} (full log: {outcome.log_path})")
    if not outcome.ok:
        raise typer.Exit(1)


@app.command()
def partition(
    run_config: RunConfigOpt = [],  # noqa: B006
    num_partitions: Annotated[int, typer.Option("--num-partitions", "-n")] = 20,
    heatmap: Annotated[Path, typer.Option(help="Where to write the PNG heatmap.")] = Path(
        "partition.png"
    ),
    export: Annotated[
        Path | None,
        typer.Option(help="Also write the partition in the clients-npz layout to this folder."),
    ] = None,
) -> None:
    """Print per-client sample and class counts of a data config; draw a heatmap."""
    from cli.partition_view import heatmap_png, table
    from data import export_partition, partition_summary, prepare_partition

    cfg, _ = config_from(run_config)
    try:
        path = prepare_partition(cfg.data, num_partitions, cfg.seed)
    except ConfigError as exc:
        typer.echo(f"fedhet: {exc}", err=True)
        raise typer.Exit(2) from None
    summary = partition_summary(path)
    typer.echo(table(summary))
    heatmap_png(summary, heatmap, title=_data_title(cfg))
    typer.echo(f"heatmap: {heatmap}")
    if export is not None:
        export_partition(cfg.data, num_partitions, cfg.seed, export)
        typer.echo(
            f"exported clients-npz layout to {export} "
            f"(run it with data.name='clients-npz' data.root='{export}')"
        )


def _data_title(cfg) -> str:  # type: ignore[no-untyped-def]
    d = flatten(cfg.data, "data.")
    keys = ("data.name", "data.partition", "data.alpha", "data.fraction")
    return " ".join(f"{k.removeprefix('data.')}={d[k]}" for k in keys) + f" seed={cfg.seed}"


@app.command()
def report(
    results: Annotated[
        list[Path], typer.Argument(help="results.json files, or the run folders holding them.")
    ],
    plot: Annotated[Path, typer.Option(help="Accuracy-vs-round PNG.")] = Path("accuracy.png"),
    title: Annotated[str, typer.Option()] = "",
) -> None:
    """Print a markdown table of finished runs and draw their accuracy against rounds.

    Runs that differ only in `seed` are folded into mean ± std; runs with a virtual
    clock also get a plot against virtual time."""
    from common.report import Run, markdown_table, plot_accuracy

    try:
        runs = [Run.load(p) for p in results]
    except ValueError as exc:
        typer.echo(f"fedhet: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(markdown_table(runs))
    plot_accuracy(runs, plot, title=title)
    typer.echo(f"\nplot: {plot}")
    if any(r.timed for r in runs):  # a fleet: accuracy against virtual time as well
        timed = plot.with_name(f"{plot.stem}-virtual{plot.suffix}")
        plot_accuracy([r for r in runs if r.timed], timed, title=title, virtual=True)
        typer.echo(f"plot against virtual time: {timed}")


@app.command()
def profile(
    measure: Annotated[
        bool,
        typer.Option(
            "--measure",
            help="Time the reference workload here and print the node-config speed.",
        ),
    ] = False,
    threads: Annotated[
        int, typer.Option(help="Torch threads for the measurement (as the node trains).")
    ] = 1,
    seconds: Annotated[float, typer.Option(help="CPU seconds per measurement.")] = 2.0,
    repeats: Annotated[int, typer.Option(help="Measurements; the median is printed.")] = 3,
) -> None:
    """Print the device classes of the virtual clock, and with --measure this machine's speed."""
    from common.devices import DEVICES

    typer.echo("| class | speed (GFLOP/s) | uplink (Mbit/s) | downlink (Mbit/s) | latency (ms) |")
    typer.echo("|---|---|---|---|---|")
    for d in DEVICES.values():
        typer.echo(
            f"| {d.name} | {d.speed:g} | {d.uplink_mbps:g} | {d.downlink_mbps:g} | "
            f"{d.latency_ms:g} |"
        )
    if not measure:
        return
    import statistics

    from models.workload import measure_speed

    speeds = [measure_speed(seconds=seconds, threads=threads) for _ in range(repeats)]
    speed = statistics.median(speeds)
    typer.echo(
        f"\nthis machine, {threads} thread(s): {speed:.2f} GFLOP/s on the reference "
        f"workload (runs: {', '.join(f'{s:.2f}' for s in speeds)})"
    )
    typer.echo(f"node-config for this device: speed={speed:.2f}")


@app.command()
def certs(
    out_dir: Annotated[Path, typer.Argument(help="Folder for ca.crt, server.pem, server.key.")],
    host: Annotated[
        list[str],
        typer.Option(
            help="Name or IP the SuperLink is reached by "
            "(repeat: --host superlink --host 127.0.0.1)."
        ),
    ],
    days: Annotated[int, typer.Option(help="Validity in days.")] = 365,
) -> None:
    """Create a private CA and a SuperLink TLS certificate with a SAN per --host."""
    from cli.security import make_certificates

    for name, path in make_certificates(out_dir, host, days).items():
        typer.echo(f"{name:11s} {path}")


@app.command()
def keys(
    out_dir: Annotated[
        Path,
        typer.Argument(help="Folder for `node-<i>`, `node-<i>.pub`, `node-<i>.superexec-secret`."),
    ],
    nodes: Annotated[int, typer.Option(help="How many SuperNode key pairs.")] = 3,
    start: Annotated[int, typer.Option(help="Index of the first pair.")] = 0,
    secrets_only: Annotated[
        bool,
        typer.Option(
            help="Only the executor secrets (node-<i>.superexec-secret), keeping the keys "
            "(keys made before fedhet had secrets)."
        ),
    ] = False,
    bundle: Annotated[
        int | None,
        typer.Option(
            help="Make nothing: pack node BUNDLE's private key, its executor secret and "
            "--ca into one archive for its device (and nothing else)."
        ),
    ] = None,
    ca: Annotated[
        Path | None, typer.Option(help="With --bundle: the CA certificate (ca.crt).")
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(help="With --bundle: the archive (default OUT_DIR/node-<i>-bundle.tar.gz)."),
    ] = None,
) -> None:
    """Create SuperNode key pairs (ECDSA P-384, OpenSSH) for node authentication and one
    executor secret per node (0400); or, with --bundle, one device's files."""
    from cli.security import bundle_node, make_node_keys, make_superexec_secrets

    if bundle is not None:
        if ca is None:
            typer.echo("fedhet: --bundle needs --ca (the CA certificate, ca.crt)", err=True)
            raise typer.Exit(2)
        target = out or out_dir / f"node-{bundle}-bundle.tar.gz"
        try:
            path = bundle_node(out_dir, bundle, ca, target)
        except (OSError, ValueError) as exc:
            typer.echo(f"fedhet: {exc}", err=True)
            raise typer.Exit(2) from None
        typer.echo(
            f"{path}  (node-{bundle}/ca.crt, node.key, superexec.secret: copy it to "
            f"device {bundle} only, see docs/devices.md)"
        )
        return
    if not secrets_only:
        for private, public in make_node_keys(out_dir, nodes, start):
            typer.echo(f"{private}  (register {public} with `flwr supernode register`)")
    for secret in make_superexec_secrets(out_dir, nodes, start):
        typer.echo(f"{secret}  (the node's SuperNode and executor: --superexec-auth-secret-file)")


def parse_node_config(text: str) -> dict[str, Scalar]:
    """``key=value`` pairs (space-separated; values as TOML: true, 3, 0.5, "text") for
    every node of ``fedhet federation``; ValueError names what does not parse."""
    import shlex

    import tomllib

    out: dict[str, Scalar] = {}
    for pair in shlex.split(text):
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"{pair!r} is not key=value")
        if key in ("partition-id", "num-partitions"):
            raise ValueError(f"{key} is set by the federation (one partition per node)")
        try:
            parsed = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            parsed = value  # a bare word: a string
        if not isinstance(parsed, (bool, int, float, str)):
            raise ValueError(f"{key}: {value!r} is not a bool, number or string")
        out[key] = parsed
    return out


@app.command()
def federation(
    run_config: RunConfigOpt = [],  # noqa: B006
    nodes: Annotated[
        int, typer.Option("--num-supernodes", "--nodes", help="SuperNodes to start.")
    ] = 3,
    profiles: Annotated[
        str, typer.Option(help="Comma-separated node profiles, assigned round-robin (empty: none).")
    ] = "",
    workdir: Annotated[Path, typer.Option(help="Certificates, keys, logs, node state.")] = Path(
        "~/.cache/fedhet/federation"
    ),
    insecure: Annotated[
        bool, typer.Option(help="No TLS, no node auth: a local shortcut only.")
    ] = False,
    cold: Annotated[
        bool,
        typer.Option(
            help="Flower's stock executor: a fresh flwr-clientapp process per message "
            "(default: the warm executor, `fedhet superexec`)."
        ),
    ] = False,
    memory_state: Annotated[
        bool,
        typer.Option(
            help="The SuperLink keeps its state in memory (Flower's default; faster per "
            "request) instead of `<workdir>/superlink.db` (a restarted SuperLink knows its "
            "nodes and runs)."
        ),
    ] = False,
    resume: ResumeOpt = None,
    link: Annotated[
        str,
        typer.Option(
            help="Put each node behind an emulated link (a user-space proxy): device "
            "classes, comma-separated, round-robin (e.g. rpi4,server; none: no link); "
            "a class's link is half its round-trip latency each way and its rates."
        ),
    ] = "",
    delay_ms: Annotated[
        float | None, typer.Option(help="Link: one-way delay each way, ms (every node).")
    ] = None,
    up_mbps: Annotated[
        float | None, typer.Option(help="Link: node-to-server rate, Mbit/s (every node).")
    ] = None,
    down_mbps: Annotated[
        float | None, typer.Option(help="Link: server-to-node rate, Mbit/s (every node).")
    ] = None,
    node_config: Annotated[
        str,
        typer.Option(
            help="Extra node config for every node, as flower-supernode --node-config "
            "takes it (e.g. 'onnx-export=true'); partition-id and num-partitions are the "
            "federation's."
        ),
    ] = "",
    verbose: Annotated[bool, typer.Option(help="Print all Flower logs.")] = False,
) -> None:
    """Start a SuperLink and N SuperNodes on 127.0.0.1, run the app once, stop them all.

    TLS and node authentication unless --insecure; exits 0 only if the run finished as
    completed."""
    from cli.federation import Federation
    from cli.linkproxy import node_links
    from common import flower_gate

    for found in (flower_gate.verdict(p.name) for p in flower_gate.PARTS):
        if not found.fits and (found.part.name != "warm-executor" or not cold):
            typer.echo(found.line(), err=True)  # the nodes' logs say it too
            if found.part.fallback is None:
                raise typer.Exit(1)
    try:
        links = node_links(nodes, link, delay_ms, up_mbps, down_mbps)
    except ValueError as exc:
        typer.echo(f"fedhet: {exc}", err=True)
        raise typer.Exit(2) from None

    overrides, _ = resumed_overrides(resume, run_config)
    names = [p.strip() for p in profiles.split(",") if p.strip()]
    work = workdir.expanduser().resolve()
    try:
        extra = parse_node_config(node_config)
    except ValueError as exc:
        typer.echo(f"fedhet: --node-config: {exc}", err=True)
        raise typer.Exit(2) from None
    node_configs = []
    for i in range(nodes):
        nc: dict[str, Scalar] = {
            "partition-id": i,
            "num-partitions": nodes,
            "state-dir": str(work / "state" / f"node-{i}"),
        }
        if names:
            nc["profile"] = names[i % len(names)]
        node_configs.append({**nc, **extra})

    def echo(line: str) -> None:
        if verbose or "[fedhet]" in line or "fedhet:" in line or "ERROR" in line:
            typer.echo(line)

    with Federation(
        work,
        node_configs,
        APP_DIR,
        secure=not insecure,
        warm=not cold,
        durable=not memory_state,
        echo=typer.echo,
        links=links,
    ) as fed:
        outcome = fed.run(overrides, echo=echo)
    typer.echo(f"run {outcome.run_id}: {outcome.status} (full log: {outcome.log_path})")
    if not outcome.ok:
        raise typer.Exit(1)


@app.command("run")
def run_deployed(
    connection: Annotated[
        str,
        typer.Argument(
            help="A SuperLink connection of $FLWR_HOME/config.toml (e.g. `compose`, "
            "docs/deployment.md)."
        ),
    ],
    run_config: RunConfigOpt = [],  # noqa: B006
    verbose: Annotated[bool, typer.Option(help="Print all Flower logs.")] = False,
) -> None:
    """Run the app on a federation that is already running (the Docker stack, devices).

    Runs `flwr run . CONNECTION --stream`, prints one line per round and exits 1 unless
    the run finished as completed (`flwr run` itself exits 0 on a failed run)."""
    from cli.launch import run_deployed as run_on

    _, overrides = config_from(run_config)

    def echo(line: str) -> None:
        if verbose or "[fedhet]" in line or "fedhet:" in line or "ERROR" in line:
            typer.echo(line)

    outcome = run_on(APP_DIR, connection, overrides, echo=echo)
    typer.echo(f"run {outcome.run_id}: {outcome.status} (full log: {outcome.log_path})")
    if not outcome.ok:
        raise typer.Exit(1)


@app.command()
def audit(
    out_dir: Annotated[Path, typer.Argument(help="A finished simulation's out-dir.")],
    clients: Annotated[int, typer.Option(help="How many clients (partitions 0..n-1).")] = 20,
    steps: Annotated[int, typer.Option(help="Optimisation steps per reconstruction.")] = 300,
) -> None:
    """Measure what the server could reconstruct from each knowledge form of a finished run.

    White-box inversion with the clients' own models; prints PSNR and SSIM per form and
    writes audit.json and a picture grid (client 0) into the out-dir."""
    from cli.audit import audit as run_audit
    from cli.audit import summarise, write_audit

    rows = run_audit(out_dir.expanduser(), clients, steps)
    typer.echo("| form | clients | PSNR closest (dB) | SSIM closest | PSNR class mean (dB) |")
    typer.echo("|---|---|---|---|---|")
    for form, s in summarise(rows).items():
        typer.echo(
            f"| {form} | {s['n']:.0f} | {s['psnr_closest']:.2f} ± {s['psnr_closest_std']:.2f} | "
            f"{s['ssim_closest']:.3f} | {s['psnr_class_mean']:.2f} |"
        )
    path, grid = write_audit(out_dir.expanduser(), rows)
    typer.echo(f"\n{path}\n{grid}")


@app.command("export")
def export_models(
    source: Annotated[Path, typer.Argument(help="A simulation's out-dir, or a node's state-dir.")],
    out: Annotated[Path, typer.Option("--out", help="Folder for the .onnx and .json files.")],
    client: Annotated[
        int | None, typer.Option(help="Only this client (partition id); default: every one.")
    ] = None,
) -> None:
    """Write each client's personal model, as it predicts, as ONNX with a JSON card beside it.

    The newest evaluated model of each client (kept at every evaluation): client-N.onnx and
    client-N.json (classes, input shape, normalisation, algorithm, round, run, accuracy on
    the client's own test split). Needs `pip install 'fedhet[export]'`."""
    from cli.export import export_run

    try:
        export_run(source, out, client, echo=typer.echo)
    except (ConfigError, ImportError) as exc:
        typer.echo(f"fedhet: {exc}", err=True)
        raise typer.Exit(1) from None


@app.command()
def predict(
    model: Annotated[Path, typer.Argument(help="A .onnx file `fedhet export` wrote.")],
    inputs: Annotated[
        list[Path], typer.Argument(help="Image files, folders of them, .npz files with 'x'.")
    ],
    dataset: Annotated[
        str, typer.Option(help="Refuse a model of another dataset (e.g. fashion-mnist).")
    ] = "",
    batch_size: Annotated[int, typer.Option(help="Images per ONNX Runtime call.")] = 256,
) -> None:
    """Print the class of each input with ONNX Runtime (no torch): input, index, name.

    An .npz with labels 'y' also gets its accuracy (on stderr); bad input stops with one
    line and exit status 1."""
    from cli.predict import run

    status = run(model, inputs, dataset, batch_size)
    if status:
        raise typer.Exit(status)


PASS_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}


@app.command(context_settings=PASS_THROUGH)
def superexec(ctx: typer.Context) -> None:
    """Run Flower's SuperExec with a warm ClientApp executor (takes `flower-superexec`'s flags).

    For `flower-supernode --isolation process`: every task is a fresh child forked from a
    parent that has imported torch, numpy and flwr once."""
    show_own_help(ctx)
    from cli.warm import exec_superexec

    exec_superexec(list(ctx.args))


def show_own_help(ctx: typer.Context) -> None:
    """With ``-h``/``--help``: this command's own help, before the Flower command's
    (which gets the flag as well and lists the flags)."""
    if {"-h", "--help"} & set(ctx.args):
        ctx.get_help()  # the rich formatter prints it


SUPERNODE_HELP = f"""Run Flower's SuperNode, polling when its next message is due (takes \
`flower-supernode`'s flags).

After a reply the node expects its next message after the shortest of the last gaps it
saw after a reply of the same kind. Until {LEAD:g} of that gap each wait is half the
time left; then it polls every {DUE_SHARE:.0%} of the gap (at least every
{SUPERNODE_POLL_S:g} s), more slowly while the message does not come. Without such a
gap it polls every {SUPERNODE_POLL_S:g} s at first and more slowly the longer it waits.
No wait is longer than {IDLE_POLL_S:g} s (`FEDHET_IDLE_POLL_S`; Flower waits
{FLOWER_IDLE_PULL_S:g} s). While its task runs it looks for the reply every
{SUPERNODE_POLL_S:g} s (Flower: {FLOWER_REPLY_WAIT_S:g} s), holds its executor's
requests for a task until a message arrives (at most {TASK_HOLD_S:g} s), and asks every
{STOP_CHECK_S:g} s whether the run was stopped (`flwr stop`). Against `fedhet superlink`,
which offers it, an empty poll is held by the SuperLink until the node's message is
there (up to 45 s) and the time held is taken off the node's next wait
(`FEDHET_HELD_PULLS=0`: never asks); where it also offers that, a held poll stands for
a heartbeat, and the node sends one only when no recent poll did
(`FEDHET_POLL_HEARTBEATS=0`: every heartbeat is sent).

`FEDHET_NODE_POLL=fast`: polls every {SUPERNODE_POLL_S:g} s from each reply on, growing
by {FAST_GROWTH:g} s per second waited up to {FLOWER_IDLE_PULL_S:g} s, and answers the
executor's requests at once."""


SUPERLINK_HELP = """Run Flower's SuperLink for large fleets (takes `flower-superlink`'s flags).

Flower's Control API middlewares run only on Control API requests (a node's or the
ServerApp's request skips them); with the state in memory a node's poll looks only at
its own messages (Flower checks every stored message on every poll), gets a message
only once all its objects are there, and a node's empty poll is held up to 45 s
(`FEDHET_HOLD_S`) until its message is (`fedhet supernode` asks for it) and, when it
declares the node's heartbeat interval, taken as the node's heartbeat; idle
connections are kept 60 s
(`FEDHET_KEEPALIVE_S`; Flower: 5 s) and every answer says so (`Keep-Alive`), which
`fedhet supernode` follows. Each change falls back to Flower's own behaviour, with one
warning line, on a Flower it was not checked against (`python -m common.flower_gate`)."""


@app.command(context_settings=PASS_THROUGH, help=SUPERLINK_HELP)
def superlink(ctx: typer.Context) -> None:
    """Flower's SuperLink with fedhet's fleet-path changes (:mod:`cli.superlink`)."""
    show_own_help(ctx)
    from cli.superlink import run_superlink

    run_superlink(list(ctx.args))


@app.command(context_settings=PASS_THROUGH, help=SUPERNODE_HELP)
def supernode(ctx: typer.Context) -> None:
    """Flower's SuperNode, paced (:data:`SUPERNODE_HELP`, :mod:`cli.supernode`)."""
    show_own_help(ctx)
    from cli.supernode import run_supernode

    run_supernode(list(ctx.args))


def main() -> None:  # pragma: no cover
    app(sys.argv[1:])
