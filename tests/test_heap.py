"""Freed heap memory given back to the system (``common.heap``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from common import heap

ROOT = Path(__file__).resolve().parent.parent

FREE_THEN_TRIM = """
import sys
from common import heap

def anon_mb():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024

blocks = [bytes(2048) for _ in range(100_000)]  # about 200 MB from malloc
pin = bytes(2048)  # allocated after them: the heap's top stays in use
held = anon_mb()
del blocks
freed = anon_mb()
trimmed = anon_mb() if not heap.trim() else anon_mb()
print(held, freed, trimmed)
"""


@pytest.mark.skipif(not heap.trim(), reason="not glibc: nothing to trim (a no-op by design)")
def test_a_trim_gives_the_freed_pages_back() -> None:
    out = subprocess.run(
        [sys.executable, "-c", FREE_THEN_TRIM], cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    held, freed, trimmed = map(float, out.stdout.split())
    assert held > 150 and freed > 150  # freed, and still resident: glibc keeps it
    assert trimmed < freed - 150, (held, freed, trimmed)


def test_the_trimmer_is_off_with_zero_and_a_bad_value_is_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(heap, "_started", [])
    assert heap.start_trimmer(0) is None and heap._started == []
    monkeypatch.setenv("FEDHET_HEAP_TRIM_S", "often")
    with pytest.raises(SystemExit, match="FEDHET_HEAP_TRIM_S='often'"):
        heap.trim_s()
    monkeypatch.setenv("FEDHET_HEAP_TRIM_S", "0")
    assert heap.start_trimmer() is None
