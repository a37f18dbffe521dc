"""Waiting in a test for something another process or thread does: one poll loop for every test.

A test waits for the condition it needs, never for a guessed time: ``wait_until`` returns as
soon as the condition holds and fails naming it.  ``holds_for`` is the other side: a condition
that must stay true for a window (that something does NOT happen within it)."""

from __future__ import annotations

import time
from typing import Callable


def _say(what: str | Callable[[], object]) -> str:
    return str(what()) if callable(what) else what


def wait_until(predicate, timeout: float = 15.0, what: str | Callable[[], object] = "condition",
               interval: float = 0.02):
    """Poll ``predicate`` until truthy and return its value; AssertionError naming ``what``
    once ``timeout`` seconds pass (checked after a last call, so a slow predicate still counts).
    ``what`` may be a callable, called at the timeout: the message then shows the state then."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {_say(what)}")
        time.sleep(interval)


def holds_for(predicate, seconds: float, what: str | Callable[[], object] = "condition",
              interval: float = 0.02) -> None:
    """Assert ``predicate`` stays truthy for ``seconds`` (the window is the behaviour under
    test: nothing may happen in it); fails at once, naming ``what``, when it turns false."""
    deadline = time.monotonic() + seconds
    while True:
        if not predicate():
            raise AssertionError(f"{_say(what)}: stopped holding within {seconds}s")
        if time.monotonic() >= deadline:
            return
        time.sleep(interval)
