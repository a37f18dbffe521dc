"""Waiting in a test for something another process does: one poll loop for every test."""

from __future__ import annotations

import time


def wait_until(predicate, timeout: float = 15.0, what: str = "condition", interval: float = 0.02):
    """Poll ``predicate`` until truthy and return its value; AssertionError naming ``what``
    once ``timeout`` seconds pass (checked after a last call, so a slow predicate still counts)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
