"""One WARNING when a process loses ZooKeeper and one INFO when it is back, instead of
kazoo's lines at every reconnection attempt (:class:`celery_zklock.engine.client.OutageLog`),
fed kazoo's own messages in the order kazoo logs them through an outage."""

from __future__ import annotations

import logging

import pytest

from celery_zklock.engine.client import OutageLog


class Said(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.levelname, record.getMessage()))


def _record(level: int, msg: str, *args) -> logging.LogRecord:
    return logging.LogRecord("kazoo.client", level, __file__, 1, msg, args, None)


W, I, E = logging.WARNING, logging.INFO, logging.ERROR
OUTAGE = [
    (I, "Zookeeper connection established, state: %s", "CONNECTED"),  # the first connect: passes
    (W, "Connection dropped: %s", "socket connection broken"),  # 1st failure: our WARNING instead
    (W, "Transition to CONNECTING"),
    (I, "Zookeeper connection lost"),
    (I, "Connecting to %s(%s):%s, use_ssl: %r", "127.0.0.1", "127.0.0.1", 2181, False),
    (W, "Connection dropped: %s", "Connection refused"),
    (I, "Connecting to %s(%s):%s, use_ssl: %r", "127.0.0.1", "127.0.0.1", 2181, False),
    (W, "Connection dropped: %s", "Connection refused"),
    (W, "Session has expired"),  # says something new: passes
    (E, "Unhandled exception in connection loop"),  # above WARNING: passes
    (I, "Connecting to %s(%s):%s, use_ssl: %r", "127.0.0.1", "127.0.0.1", 2181, False),
    (I, "Zookeeper connection established, state: %s", "CONNECTED"),  # back: our INFO instead
    (I, "Connecting to %s(%s):%s, use_ssl: %r", "127.0.0.1", "127.0.0.1", 2181, False),  # up again: passes
]
PASSED = [0, 8, 9, 12]


def test_an_outage_is_one_warning_and_one_info():
    logger = logging.getLogger(f"test-outage-{id(object())}")
    said = Said()
    logger.addHandler(said)
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    now = [100.0]
    log = OutageLog(logger, clock=lambda: now[0])
    passed = []
    for i, (level, msg, *args) in enumerate(OUTAGE):
        if i == 11:
            now[0] = 112.5
        if log.filter(_record(level, msg, *args)):
            passed.append(i)
    assert passed == PASSED
    assert said.lines == [
        ("WARNING", "celery-zklock: ZooKeeper unreachable (Connection dropped: socket connection broken); "
                    "reconnecting, and saying so once it is back"),
        ("INFO", "celery-zklock: ZooKeeper reachable again after 12.5 s (2 attempt(s) failed)"),
    ]


@pytest.mark.parametrize("level, msg, passes", [
    (I, "Connecting to 127.0.0.1(127.0.0.1):2181, use_ssl: False", True),  # a normal connect
    (I, "Zookeeper connection established, state: CONNECTED", True),
    (W, "Session has expired", True),
    (I, "Closing connection to 127.0.0.1:2181", True),  # a clean stop
])
def test_outside_an_outage_kazoo_speaks_for_itself(level, msg, passes):
    log = OutageLog(logging.getLogger("test-outage-quiet"))
    assert log.filter(_record(level, msg)) is passes
