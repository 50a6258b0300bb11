"""Start Flower processes on loopback, run an app with ``flwr run``, clean up.

Used by ``fedhet simulate`` (the README's run command), the end-to-end tests and the
benchmarks, so they all exercise exactly what a user runs. Every process is started
in its own process group and the whole group is killed on exit; the run's real
status is read back with ``flwr list`` (``flwr run --stream`` exits 0 on failure).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

Scalar = bool | int | float | str

FLOWER_ENV = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
}
"""Environment every Flower process of ours gets (see README, "Environment")."""


@contextlib.contextmanager
def sigterm_as_exit() -> Iterator[None]:
    """Turn SIGTERM into SystemExit so ``finally`` blocks stop what we started."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


_PORTS_GIVEN: set[int] = set()
_PORTS_LOCK = threading.Lock()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now and that this process has not
    handed out before: the kernel may give a port it gave a moment ago once its socket
    is closed (a federation's node once got the SuperLink's own port, and failed)."""
    with _PORTS_LOCK:
        for _ in range(1000):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = int(s.getsockname()[1])
            if port not in _PORTS_GIVEN:
                _PORTS_GIVEN.add(port)
                return port
    raise OSError("no free port on 127.0.0.1 that was not handed out already")


def flower_env(flwr_home: Path, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    from common.provenance import launch_env

    env = dict(os.environ)
    env.update(FLOWER_ENV)
    env.update(launch_env())  # the checkout's git commit, for results.json's "versions"
    env["FLWR_HOME"] = str(flwr_home)
    env.update(extra or {})
    return env


def children_map() -> dict[int, list[int]]:
    """Parent pid -> child pids, from one pass over /proc (empty where there is none)."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return children
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    return children


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (read from /proc; empty where there is none)."""
    children = children_map()
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def signal_tree(pids: list[int], sig: int) -> None:
    """Send ``sig`` to every process group in ``pids`` and to every pid."""
    groups = set()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            groups.add(os.getpgid(pid))
    for group in groups - {os.getpgrp()}:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, sig)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


STOP_GRACE_S = 5.0
"""How long :meth:`Processes.stop_all` lets every process end by itself after SIGTERM
before it SIGKILLs what is left (a SuperNode's graceful exit took up to 5 s on a loaded
machine)."""


class Processes:
    """Processes started in their own groups; :meth:`stop_all` kills every group."""

    def __init__(self, env: dict[str, str], log_dir: Path) -> None:
        self.env, self.log_dir = env, log_dir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        log_dir.mkdir(parents=True, exist_ok=True)

    def start(self, name: str, cmd: list[str], cwd: Path | None = None) -> subprocess.Popen[bytes]:
        log = (self.log_dir / f"{name}.log").open("ab")
        proc = subprocess.Popen(
            cmd,
            env=self.env,
            cwd=cwd,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.procs[name] = proc
        return proc

    def stop(self, name: str, sig: int = signal.SIGTERM, grace: float = 10.0) -> None:
        """Signal the process and everything it started, then SIGKILL what is left.

        Flower's SuperLink and SuperNode start their SuperExec (and through it the
        simulation, Ray and ClientApps) in a process group of its own, so the tree
        is collected first and every group in it is signalled.
        """
        if name in self.procs:
            self._stop([self.procs.pop(name)], sig, grace)

    def stop_all(self, grace: float = STOP_GRACE_S) -> None:
        """:meth:`stop` for every process at once: one SIGTERM to all of them, one
        grace period for all, then SIGKILL (stopped one by one, a federation of N nodes
        took up to 2N + 1 graceful exits: about 40 s on a busy machine)."""
        procs = list(reversed(self.procs.values()))
        self.procs.clear()
        self._stop(procs, signal.SIGTERM, grace)

    @staticmethod
    def _stop(procs: list[subprocess.Popen[bytes]], sig: int, grace: float) -> None:
        """Signal every process in ``procs`` and every process below them with ``sig``,
        wait until each of ``procs`` has exited or ``grace`` has passed, then SIGKILL
        everything that is left below them (and what they started meanwhile)."""
        tree = [pid for proc in procs for pid in (proc.pid, *descendants(proc.pid))]
        signal_tree(tree, sig)
        deadline = time.monotonic() + grace
        while any(proc.poll() is None for proc in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        signal_tree(tree + [p for pid in tree for p in descendants(pid)], signal.SIGKILL)
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)


def wait_http(
    url: str,
    timeout: float,
    proc: subprocess.Popen[bytes] | None = None,
    context: object | None = None,
) -> None:
    """Poll ``url`` until it answers 2xx; fail early if ``proc`` exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} was up")
        try:
            with urllib.request.urlopen(url, timeout=1, context=context):  # type: ignore[arg-type]
                return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"{url} not up after {timeout:.0f} s")


def remove_connection(flwr_home: Path, name: str) -> str:
    """Drop connection ``name`` from ``$FLWR_HOME/config.toml``; return the new text."""
    flwr_home.mkdir(parents=True, exist_ok=True)
    path = flwr_home / "config.toml"
    text = (
        path.read_text()
        if path.exists()
        else '[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = ":local:"\n'
    )
    kept, skipping = [], False
    for line in text.splitlines():
        if line.startswith("["):
            skipping = line.strip() == f"[superlink.{name}]"
        if not skipping:
            kept.append(line)
    text = "\n".join(kept).rstrip("\n") + "\n"
    path.write_text(text)
    return text


def write_connection(
    flwr_home: Path, name: str, address: str, *, root_certificates: Path | None = None
) -> None:
    """Add (or replace) a SuperLink connection in ``$FLWR_HOME/config.toml``."""
    path = flwr_home / "config.toml"
    text = remove_connection(flwr_home, name)
    block = f'\n[superlink.{name}]\naddress = "{address}"\n'
    block += (
        f'root-certificates = "{root_certificates}"\n' if root_certificates else "insecure = true\n"
    )
    path.write_text(text.rstrip("\n") + "\n" + block)


def toml_value(value: Scalar) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(value)


def write_run_config(overrides: Mapping[str, Scalar], directory: Path) -> Path:
    """Overrides as a TOML file for ``flwr run --run-config FILE.toml``."""
    path = directory / "run-config.toml"
    path.write_text("".join(f'"{k}" = {toml_value(v)}\n' for k, v in overrides.items()))
    return path


def run_status(env: dict[str, str], conn: str, run_id: int, cwd: Path) -> str:
    """The run's status string as ``flwr list`` reports it (e.g. finished:completed)."""
    out = subprocess.run(
        ["flwr", "list", conn, "--run-id", str(run_id), "--format", "json"],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
    )
    try:
        runs = json.loads(out.stdout)["runs"]
        return str(runs[0]["status"])
    except (ValueError, KeyError, IndexError):
        return f"unknown ({out.stdout.strip()[:200]} {out.stderr.strip()[:200]})"


@dataclass(frozen=True)
class RunOutcome:
    """What happened to one ``flwr run``."""

    run_id: int | None
    status: str
    log_path: Path

    @property
    def ok(self) -> bool:
        return self.status == "finished:completed"


def stream_run(
    cmd: list[str],
    env: dict[str, str],
    cwd: Path,
    log_path: Path,
    echo: Callable[[str], None] | None,
    timeout: float,
) -> int | None:
    """Run ``flwr run ... --stream``, log everything, echo lines; return the run id."""
    run_id = None
    deadline = time.monotonic() + timeout
    with (
        log_path.open("a") as log,
        subprocess.Popen(
            cmd,
            env=env,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        ) as proc,
    ):
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                log.write(line)
                log.flush()
                if run_id is None and (m := re.search(r"run (\d+)", line)):
                    run_id = int(m.group(1))
                if echo is not None:
                    echo(line.rstrip("\n"))
                if time.monotonic() > deadline:
                    raise TimeoutError(f"flwr run exceeded {timeout:.0f} s")
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    return run_id


@contextlib.contextmanager
def simulation_superlink(
    flwr_home: Path, extra_env: Mapping[str, str] | None = None
) -> Iterator[tuple[str, dict[str, str], Processes]]:
    """A simulation SuperLink on free loopback ports; yields (connection, env, procs)."""
    env = flower_env(flwr_home, extra_env)
    procs = Processes(env, flwr_home / "logs")
    port = free_port()
    conn = f"fedhet-sim-{port}"
    with sigterm_as_exit(), contextlib.ExitStack() as stack:
        stack.callback(remove_connection, flwr_home, conn)
        stack.callback(procs.stop_all)
        sl = procs.start(
            "superlink",
            [
                "flower-superlink",
                "--insecure",
                "--simulation",
                "--isolation",
                "subprocess",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--disable-runtime-dependency-installation",
            ],
        )
        wait_http(f"http://127.0.0.1:{port}/health", 60, sl)
        write_connection(flwr_home, conn, f"127.0.0.1:{port}")
        yield conn, env, procs


def simulation_command(
    app_dir: Path, conn: str, num_supernodes: int, cpus_per_client: int, config: Path | None
) -> list[str]:
    """``flwr run app_dir conn --stream`` as a simulation of ``num_supernodes`` nodes,
    with the run-config file ``config`` if given."""
    cmd = [
        "flwr",
        "run",
        str(app_dir),
        conn,
        "--stream",
        "--federation-config",
        f"num-supernodes={num_supernodes} client-resources-num-cpus={cpus_per_client}",
    ]
    return cmd + (["--run-config", str(config)] if config is not None else [])


def run_simulation(
    app_dir: Path,
    overrides: Mapping[str, Scalar],
    *,
    num_supernodes: int,
    cpus_per_client: int = 1,
    flwr_home: Path | None = None,
    timeout: float = 3600,
    echo: Callable[[str], None] | None = None,
    extra_env: Mapping[str, str] | None = None,
) -> RunOutcome:
    """``flwr run app_dir`` as a local simulation on its own SuperLink; clean up after."""
    app_dir = Path(app_dir).resolve()
    home = Path(flwr_home or os.environ.get("FLWR_HOME") or app_dir / ".flwr").resolve()
    with (
        tempfile.TemporaryDirectory() as tmp,
        simulation_superlink(home, extra_env) as (conn, env, _),
    ):
        log_path = home / "logs" / f"{conn}.run.log"
        config = write_run_config(overrides, Path(tmp)) if overrides else None
        cmd = simulation_command(app_dir, conn, num_supernodes, cpus_per_client, config)
        run_id = stream_run(cmd, env, app_dir, log_path, echo, timeout)
        status = run_status(env, conn, run_id, app_dir) if run_id else "not started"
        return RunOutcome(run_id, status, log_path)


def run_deployed(
    app_dir: Path,
    connection: str,
    overrides: Mapping[str, Scalar],
    *,
    flwr_home: Path | None = None,
    timeout: float = 24 * 3600,
    echo: Callable[[str], None] | None = None,
) -> RunOutcome:
    """``flwr run app_dir connection --stream`` on a federation that is already running
    (the Docker stack, devices), with the real status from ``flwr list`` afterwards."""
    app_dir = Path(app_dir).resolve()
    home = Path(flwr_home or os.environ.get("FLWR_HOME") or app_dir / ".flwr").resolve()
    env = flower_env(home)
    (home / "logs").mkdir(parents=True, exist_ok=True)
    log_path = home / "logs" / f"{connection}-{int(time.time() * 1000)}.run.log"
    with sigterm_as_exit(), tempfile.TemporaryDirectory() as tmp:
        cmd = ["flwr", "run", str(app_dir), connection, "--stream"]
        if overrides:
            cmd += ["--run-config", str(write_run_config(overrides, Path(tmp)))]
        run_id = stream_run(cmd, env, app_dir, log_path, echo, timeout)
        status = run_status(env, connection, run_id, app_dir) if run_id else "not started"
    return RunOutcome(run_id, status, log_path)
