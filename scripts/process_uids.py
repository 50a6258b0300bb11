"""Check the uid of every process running in the compose stack's containers.

What a container runs as is decided when it starts (compose ``user:``, else the image's
``USER``, else root) and a file's mode says nothing about it; so this reads the live
processes. ``scripts/compose-check.sh`` feeds it one line per process, as ``docker top
CONTAINER -eo uid,pid,args`` prints them, prefixed with the compose service name::

    superlink 1000 12345 /opt/fedhet/bin/python /opt/fedhet/bin/fedhet superlink ...

and the compose file as ``docker compose config`` prints it; it prints a table and
exits 1 naming every process whose uid is not its service's, and every long-running
service that has no process.

    python scripts/process_uids.py --config CONFIG.yml --dockerfile Dockerfile < ROWS
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

import yaml

ONE_SHOT = {"init", "register"}
"""Services that exit once done (not expected to be running)."""


def image_uid(dockerfile: str) -> int:
    """The uid the image's final stage runs as: its last ``USER`` (numeric), else 0."""
    final = dockerfile.rsplit("\nFROM ", 1)[-1]
    users = re.findall(r"^USER\s+(\S+)", final, re.M)
    if not users:
        return 0
    uid = users[-1].split(":")[0]
    if not uid.isdigit():
        raise ValueError(f"USER {users[-1]}: give the uid as a number (what `docker top` shows)")
    return int(uid)


def expected_uids(config: Mapping, image: int) -> dict[str, int]:
    """Service -> the uid its processes must have: its ``user:`` (the uid part; the
    config has ``${FEDHET_UID}`` substituted), else the image's."""
    out = {}
    for name, svc in config["services"].items():
        user = str(svc.get("user", "")).split(":")[0]
        if user == "root":
            out[name] = 0
        elif user:
            out[name] = int(user)
        else:
            out[name] = image
    return out


def parse_rows(lines: Iterable[str]) -> list[tuple[str, int, int, str]]:
    """``service uid pid args`` lines -> tuples (header lines of ``docker top`` skipped)."""
    rows = []
    for line in lines:
        parts = line.split(None, 3)
        if len(parts) < 3 or not parts[1].isdigit():
            continue
        rows.append((parts[0], int(parts[1]), int(parts[2]), parts[3] if len(parts) > 3 else ""))
    return rows


def check(rows: list[tuple[str, int, int, str]], expected: Mapping[str, int]) -> list[str]:
    """Every problem, one line each: a process of a service with another uid, a process of
    a service the compose file does not have, a long-running service without a process."""
    problems = []
    for service, uid, pid, args in rows:
        want = expected.get(service)
        if want is None:
            problems.append(f"{service}: not a service of the compose file (pid {pid})")
        elif uid != want:
            problems.append(f"{service}: pid {pid} runs as uid {uid}, want {want}: {args[:120]}")
    running = {row[0] for row in rows}
    for service in sorted(set(expected) - ONE_SHOT - running):
        problems.append(f"{service}: no running process")
    return problems


def table(rows: list[tuple[str, int, int, str]], expected: Mapping[str, int]) -> str:
    """One line per service: the uids its processes run as, how many, the uid wanted."""
    lines = []
    for service in sorted({row[0] for row in rows}):
        mine = [row for row in rows if row[0] == service]
        uids = ",".join(str(u) for u in sorted({row[1] for row in mine}))
        lines.append(
            f"  {service:12s} {len(mine):3d} processes, uid {uids} "
            f"(want {expected.get(service, '?')})"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, required=True, help="docker compose config output")
    parser.add_argument("--dockerfile", type=Path, required=True)
    args = parser.parse_args(argv)
    config = yaml.safe_load(args.config.read_text())
    expected = expected_uids(config, image_uid(args.dockerfile.read_text()))
    rows = parse_rows(sys.stdin)
    print(table(rows, expected))
    problems = check(rows, expected)
    for problem in problems:
        print(f"process uid: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
