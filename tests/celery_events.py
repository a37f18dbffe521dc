"""Celery's events as a test receives them: a receiver on a thread of its own, ready (its
queue bound, which a probe event shows) before the events under test are sent."""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

from tests.polling import wait_until


@contextlib.contextmanager
def received_events(app) -> Iterator[list[dict]]:
    """The events of ``app``'s broker, appended as they come, from a receiver that is ready."""
    seen: list[dict] = []
    with app.connection() as conn:
        recv = app.events.Receiver(conn, handlers={"*": seen.append})
        listener = threading.Thread(target=lambda: recv.capture(limit=None, timeout=None, wakeup=False), daemon=True)
        listener.start()

        def probed() -> bool:
            with app.events.default_dispatcher() as dispatcher:
                dispatcher.send("test-probe")
            return any(e["type"] == "test-probe" for e in seen)

        try:
            wait_until(probed, 10, interval=0.2, what="the event receiver's queue bound")
            yield seen
        finally:
            recv.should_stop = True
