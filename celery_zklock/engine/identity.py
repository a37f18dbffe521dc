"""Who owns a lock node: the data every node we create carries, built and parsed here only.

Why one type: the node's data is read by the worker-loss reaper (is this the dead child's
node?), by redelivery handling (is this a copy of my task id and attempt?), by
``celery zklock status`` and by operators.  A field renamed in one writer and not in a
reader would silently break release-on-worker-loss; one type makes that impossible.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class Identity:
    """A lock node's owner.  Serialised as compact JSON; fields that are None are left out."""

    host: str
    pid: int
    task_id: str | None = None
    retries: int | None = None
    task: str | None = None
    worker: str | None = None
    thread: str | None = None
    holders: int | None = None  # the lock's max_holders when > 1: readers see every holder

    @classmethod
    def of_this_process(cls, **fields) -> "Identity":
        return cls(host=socket.gethostname(), pid=os.getpid(), **fields)

    @classmethod
    def of_this_thread(cls) -> "Identity":
        """What a node says when the caller gives no identifier: host, pid, thread."""
        return cls.of_this_process(thread=threading.current_thread().name)

    def to_bytes(self) -> bytes:
        # The fields are flat: no asdict() (a recursive copy, most of this call's cost, made
        # for every locked task in the worker's main process).
        return json.dumps({k: v for k, v in vars(self).items() if v is not None}, separators=(",", ":")).encode()

    def __str__(self) -> str:
        return self.to_bytes().decode()

    @classmethod
    def parse(cls, data: bytes | str | None) -> "Identity | None":
        """The identity in a node's data; None for data of another shape (Curator's, kazoo's)."""
        if data is None:
            return None
        try:
            info = json.loads(data)
        except (TypeError, ValueError):
            return None
        if not isinstance(info, dict) or not isinstance(info.get("host"), str) or not isinstance(info.get("pid"), int):
            return None
        known = {k: info.get(k) for k in ("task_id", "retries", "task", "worker", "thread", "holders")}
        return cls(host=info["host"], pid=info["pid"], **known)

    @property
    def delivery(self) -> tuple[str, int] | None:
        """(task id, attempt) of the task run that queued this node, None if not a task's."""
        return None if self.task_id is None else (self.task_id, self.retries or 0)
