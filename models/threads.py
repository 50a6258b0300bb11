"""Torch thread counts for a block of code (imports torch and nothing else)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run a block with ``n`` torch intra-op threads (restored after).

    Used where threads only add overhead (thousands of tiny steps), and where a
    block must run with a set count whatever the process's setting is.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
