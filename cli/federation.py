"""A real federation on one machine: SuperLink + N SuperNodes as processes.

TLS and SuperNode authentication are on unless ``secure=False``; each node's warm
executor authenticates to its SuperNode with the node's own secret
(``--superexec-auth-secret-file``) either way. The commands are
built by :func:`superlink_command` / :func:`supernode_command`, the same functions
whose output ``docker-compose.yml`` is checked against, so what is tested on
loopback is what the containers run.
"""

from __future__ import annotations

import json
import re
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cli.launch import (
    Processes,
    RunOutcome,
    Scalar,
    flower_env,
    free_port,
    run_status,
    sigterm_as_exit,
    stream_run,
    toml_value,
    wait_http,
    write_connection,
    write_run_config,
)
from cli.linkproxy import Link, wait_listening
from cli.security import (
    make_certificates,
    make_node_keys,
    make_superexec_secrets,
    superexec_secret_path,
)

CONNECTION = "fedhet-federation"


def superlink_command(
    *,
    host: str,
    port: int,
    certs: Path | None,
    isolation: str = "subprocess",
    database: Path | None = None,
) -> list[str]:
    """``fedhet superlink`` (Flower's, :mod:`cli.superlink`) with TLS + node auth (or
    ``--insecure`` when certs is None);
    ``database``: its state (registered nodes, runs) in a file, so a restarted
    SuperLink knows its nodes again."""
    cmd = ["fedhet", "superlink"]
    if certs is None:
        cmd += ["--insecure"]
    else:
        cmd += [
            "--ssl-ca-certfile",
            str(certs / "ca.crt"),
            "--ssl-certfile",
            str(certs / "server.pem"),
            "--ssl-keyfile",
            str(certs / "server.key"),
            "--enable-supernode-auth",
        ]
    if database is not None:
        cmd += ["--database", str(database)]
    return cmd + [
        "--host",
        host,
        "--port",
        str(port),
        "--isolation",
        isolation,
        "--disable-runtime-dependency-installation",
    ]


def node_config_string(config: Mapping[str, Scalar]) -> str:
    """``partition-id=0 num-partitions=3 profile="rpi4"`` (TOML values)."""
    return " ".join(f"{k}={toml_value(v)}" for k, v in config.items())


def supernode_command(
    *,
    superlink: str,
    host: str,
    port: int,
    ca: Path | None,
    key: Path | None,
    node_config: Mapping[str, Scalar],
    superexec_secret: Path | None,
    warm: bool = True,
) -> list[str]:
    """The SuperNode with TLS root certificate and its auth key (or insecure).

    ``warm``: ``fedhet supernode`` (Flower's, with short polling) in process isolation,
    its tasks run by a :func:`superexec_command` next to it, which must prove it holds
    ``superexec_secret`` (the same file) before it gets a task; otherwise Flower's stock
    ``flower-supernode`` starting its own SuperExec (a fresh process per message; Flower
    ignores a secret in that mode)."""
    cmd = ["fedhet", "supernode"] if warm else ["flower-supernode"]
    cmd += ["--superlink", superlink]
    cmd += ["--insecure"] if ca is None else ["--root-certificates", str(ca)]
    if key is not None:
        cmd += ["--auth-supernode-private-key", str(key)]
    if warm:
        cmd += ["--isolation", "process"]
        if superexec_secret is not None:
            cmd += ["--superexec-auth-secret-file", str(superexec_secret)]
    return cmd + [
        "--host",
        host,
        "--port",
        str(port),
        "--node-config",
        node_config_string(node_config),
    ]


def superexec_command(*, runtime_api: str, secret: Path | None) -> list[str]:
    """``fedhet superexec`` (the warm executor) for the SuperNode whose Runtime API is
    ``runtime_api`` (the node's own address, plain HTTP, as Flower's own SuperExec
    connects), signing its task requests with the node's ``secret``."""
    cmd = ["fedhet", "superexec", "--insecure", "--runtime-api-address", runtime_api]
    return cmd + ([] if secret is None else ["--superexec-auth-secret-file", str(secret)])


@dataclass
class Federation:
    """SuperLink + SuperNodes on 127.0.0.1 under ``workdir``; use as a context manager."""

    workdir: Path
    node_configs: Sequence[Mapping[str, Scalar]]
    app_dir: Path
    secure: bool = True
    warm: bool = True
    """Warm executor (``fedhet superexec``) per node; False: Flower's stock one."""
    durable: bool = True
    """The SuperLink's state in ``<workdir>/superlink.db`` (a killed SuperLink is
    restarted knowing its nodes and runs); False: Flower's in-memory state (faster
    per request, lost with the process)."""
    echo: Callable[[str], None] | None = None
    links: Sequence[Link | None] = ()
    """Node i reaches the SuperLink over ``links[i]`` (a ``cli.linkproxy`` process
    in between; None or no entry: directly)."""
    port: int = field(default_factory=free_port)
    node_ports: list[int] = field(default_factory=list)
    node_ids: dict[int, int] = field(default_factory=dict)
    """Node index -> SuperNode id (known once its key is registered)."""

    def __post_init__(self) -> None:
        self.workdir = Path(self.workdir).resolve()
        self.home = self.workdir / "flwr-home"
        self.env = flower_env(self.home)
        self.procs = Processes(self.env, self.workdir / "logs")
        self.certs = self.workdir / "certs" if self.secure else None
        self.keys = self.workdir / "keys"
        self.node_ports = [free_port() for _ in self.node_configs]
        self.link_ports = {i: free_port() for i, link in enumerate(self.links) if link}

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> Federation:
        self._sigterm = sigterm_as_exit()
        self._sigterm.__enter__()
        try:
            self.start()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop()
        finally:
            self._sigterm.__exit__(None, None, None)

    def _say(self, text: str) -> None:
        if self.echo:
            self.echo(text)

    def start(self) -> None:
        if self.certs is not None:
            make_certificates(self.certs, ["localhost", "127.0.0.1"])
            make_node_keys(self.keys, len(self.node_configs) + 1)  # +1: never registered
        if self.warm:
            make_superexec_secrets(self.keys, len(self.node_configs))
        self.start_superlink()
        write_connection(
            self.home,
            CONNECTION,
            f"127.0.0.1:{self.port}",
            root_certificates=self.certs / "ca.crt" if self.certs else None,
        )
        self._say(
            f"SuperLink up on 127.0.0.1:{self.port} "
            f"({'TLS + node auth' if self.certs else 'insecure'})"
        )
        if self.certs is not None:
            for i in range(len(self.node_configs)):
                out = self.flwr(
                    "supernode", "register", str(self.keys / f"node-{i}.pub"), CONNECTION
                )
                self.node_ids[i] = int(re.search(r"SuperNode (\d+)", out).group(1))  # type: ignore[union-attr]
        self.start_links()
        for i in range(len(self.node_configs)):
            self.start_node(i)
        self.wait_online(len(self.node_configs))
        self._say(f"{len(self.node_configs)} SuperNodes online")

    def stop(self) -> None:
        self.procs.stop_all()

    def start_superlink(self) -> None:
        """The SuperLink, its state in ``<workdir>/superlink.db``; wait until healthy."""
        cmd = superlink_command(
            host="127.0.0.1",
            port=self.port,
            certs=self.certs,
            database=self.workdir / "superlink.db" if self.durable else None,
        )
        proc = self.procs.start("superlink", cmd)
        scheme = "https" if self.certs else "http"
        ctx = ssl.create_default_context(cafile=str(self.certs / "ca.crt")) if self.certs else None
        wait_http(f"{scheme}://127.0.0.1:{self.port}/health", 60, proc, context=ctx)

    def restart_superlink(self, sig: int = signal.SIGKILL) -> None:
        """Kill the SuperLink (and the ServerApp it runs), start it again on the same
        port and database; wait until every SuperNode is back online."""
        self.procs.stop("superlink", sig=sig)
        self.start_superlink()
        self.wait_online(len(self.node_configs), timeout=180)

    def start_links(self) -> None:
        """A link proxy (``cli.linkproxy``) per node with a link, listening on
        ``link_ports[i]`` and forwarding to the SuperLink; its counts in
        ``<workdir>/logs/link-<i>.json``."""
        for i, port in self.link_ports.items():
            self.procs.start(f"link-{i}", self.link_command(i))
            wait_listening(port)
            self._say(f"node {i} reaches the SuperLink over a link: {self.links[i]}")

    def link_command(self, i: int) -> list[str]:
        link = self.links[i]
        assert link is not None
        cmd = [sys.executable, "-m", "cli.linkproxy", "--listen", f"127.0.0.1:{self.link_ports[i]}"]
        cmd += ["--target", f"127.0.0.1:{self.port}", *link.argv()]
        return cmd + ["--stats", str(self.workdir / "logs" / f"link-{i}.json")]

    # ------------------------------------------------------------------ nodes
    def node_command(self, i: int, key_index: int | None = None) -> list[str]:
        key = None
        if self.certs is not None:
            key = self.keys / f"node-{i if key_index is None else key_index}"
        return supernode_command(
            superlink=f"127.0.0.1:{self.link_ports.get(i, self.port)}",
            host="127.0.0.1",
            port=self.node_ports[i],
            ca=self.certs / "ca.crt" if self.certs else None,
            key=key,
            node_config=self.node_configs[i],
            superexec_secret=self.secret(i),
            warm=self.warm,
        )

    def secret(self, i: int) -> Path | None:
        """Node ``i``'s executor secret (None with Flower's stock executor)."""
        return superexec_secret_path(self.keys, i) if self.warm else None

    def start_node(self, i: int) -> subprocess.Popen[bytes]:
        proc = self.procs.start(f"supernode-{i}", self.node_command(i))
        if self.warm:
            runtime_api = f"127.0.0.1:{self.node_ports[i]}"
            self.procs.start(
                f"superexec-{i}", superexec_command(runtime_api=runtime_api, secret=self.secret(i))
            )
        return proc

    def stop_node(self, i: int, sig: int) -> None:
        self.procs.stop(f"supernode-{i}", sig=sig)
        self.procs.stop(f"superexec-{i}", sig=sig)

    def flwr(self, *args: str, timeout: float = 60) -> str:
        out = subprocess.run(
            ["flwr", *args],
            env=self.env,
            cwd=self.app_dir,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if out.returncode != 0:
            raise RuntimeError(
                f"flwr {' '.join(args)} failed: {out.stdout[-500:]} {out.stderr[-500:]}"
            )
        return out.stdout

    def node_status(self) -> dict[int, str]:
        """Node id -> status as the SuperLink reports it."""
        text = self.flwr("supernode", "list", CONNECTION, "--format", "json")
        nodes = json.loads(text).get("nodes", [])  # none while a SuperLink (re)starts
        return {int(n["node-id"]): str(n.get("status")) for n in nodes}

    def online_nodes(self) -> int:
        return sum(1 for status in self.node_status().values() if status == "online")

    def restart_node(self, i: int, sig: int = signal.SIGKILL, timeout: float = 180) -> None:
        """Stop node ``i``, wait until the SuperLink has let go of it, start it again.

        After a SIGKILL the SuperLink keeps the node's session until its heartbeat
        expires; a new process with the same key is refused until then.
        """
        self.stop_node(i, sig)
        nid = self.node_ids.get(i)
        deadline = time.monotonic() + timeout
        while nid is not None and self.node_status().get(nid) == "online":
            if time.monotonic() > deadline:
                raise TimeoutError(f"SuperLink still has node {nid} online")
            time.sleep(2)
        self.start_node(i)
        self.wait_online(len(self.node_configs))

    def wait_online(self, count: int, timeout: float = 180) -> None:
        """Until ``count`` SuperNodes are online (3 nodes starting their warm executors
        on a loaded 2-core machine can take more than a minute); else an error that
        names each node's status and ends with the log of each one not online."""
        deadline = time.monotonic() + timeout
        exited: list[str] = []
        while time.monotonic() < deadline and not exited:
            if self.online_nodes() >= count:
                return
            exited = self.exited_nodes()
            if not exited:
                time.sleep(1)
        status = self.node_status()
        lines, tails = [], []
        for i in range(len(self.node_configs)):
            nid = self.node_ids.get(i)
            state = status.get(nid, "unknown") if nid is not None else "not registered here"
            lines.append(f"supernode-{i}: {state}")
            if state != "online":
                log = self.workdir / "logs" / f"supernode-{i}.log"
                text = log.read_text(errors="replace") if log.exists() else "(no log)"
                tails.append(f"--- {log} (end) ---\n{text[-2000:]}")
        online = sum(s == "online" for s in status.values())
        if exited:
            raise RuntimeError(
                f"only {online} of {count} SuperNodes online: {', '.join(exited)} "
                f"({', '.join(lines)})\n" + "\n".join(tails)
            )
        raise TimeoutError(
            f"only {online} of {count} SuperNodes online after {timeout:g} s "
            f"({', '.join(lines)})\n" + "\n".join(tails)
        )

    def exited_nodes(self) -> list[str]:
        """'supernode-<i> exited with code <c>' for each node process that has ended."""
        out = []
        for i in range(len(self.node_configs)):
            proc = self.procs.procs.get(f"supernode-{i}")
            if proc is not None and proc.poll() is not None:
                out.append(f"supernode-{i} exited with code {proc.returncode}")
        return out

    # ------------------------------------------------------------------ runs
    def run(
        self,
        overrides: Mapping[str, Scalar],
        timeout: float = 1800,
        echo: Callable[[str], None] | None = None,
    ) -> RunOutcome:
        """``flwr run <app> fedhet-federation --stream``; the real status from ``flwr list``."""
        cfg_dir = self.workdir / "run-config"
        cfg_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.workdir / "logs" / f"run-{int(time.time() * 1000)}.log"
        cmd = [
            "flwr",
            "run",
            str(self.app_dir),
            CONNECTION,
            "--stream",
            "--run-config",
            str(write_run_config(overrides, cfg_dir)),
        ]
        start = time.monotonic()
        run_id = stream_run(cmd, self.env, self.app_dir, log_path, echo or self.echo, timeout)
        status = run_status(self.env, CONNECTION, run_id, self.app_dir) if run_id else "not started"
        # the log stream can end before the run does (a SuperLink busy with many nodes
        # let it go): wait for the run itself, within the same timeout
        while run_id and not status.startswith("finished") and time.monotonic() - start < timeout:
            time.sleep(2.0)
            status = run_status(self.env, CONNECTION, run_id, self.app_dir)
        return RunOutcome(run_id, status, log_path)
