"""Numeric settings from the environment, checked when a process starts."""

from __future__ import annotations

import os


def nonnegative(name: str, default: float, what: str) -> float:
    """Environment variable ``name``: a finite number ≥ 0, else ``default`` when unset;
    any other value stops with one line naming it and ``what`` it should be."""
    text = os.environ.get(name, "").strip()
    try:
        value = float(text) if text else default
    except ValueError:
        raise SystemExit(f"{name}={text!r}: {what}") from None
    if not 0 <= value < float("inf"):
        raise SystemExit(f"{name}={text!r}: {what}")
    return value
