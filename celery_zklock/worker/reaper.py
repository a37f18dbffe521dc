"""The reaper: a short-lived process that deletes a dead pool child's lock nodes.

Why a process of its own (``python -m celery_zklock.worker.reaper``, job on stdin): the prefork
parent must do no ZooKeeper I/O — a kazoo client's threads alive in the parent while the
pool forks a replacement child would be copied into it mid-operation.  The reaper waits
until the child's pid is really dead (a node must never be deleted under a live holder),
then deletes exactly the nodes whose data names this host, that pid and that task id.
If anything fails, the dead child's session timeout remains the bound.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

# Standard logging and no Celery import: this process starts on the critical path of a
# handoff (see celery_zklock/__init__.py).
logger = logging.getLogger("celery_zklock.worker.reaper")


def pid_dead(pid: int) -> bool:
    """True once ``pid`` has exited (a zombie counts: it runs no code)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False


def reap_nodes(settings: dict, paths: list[str], task_id: str, pid: int, host: str, wait_dead: float = 5.0) -> int:
    """Delete the lock nodes under ``paths`` owned by ``task_id`` in dead ``pid`` on ``host``."""
    from kazoo.exceptions import NoNodeError

    from ..config import from_wire
    from ..engine.client import connect, disconnect
    from ..engine.identity import Identity

    deadline = time.monotonic() + wait_dead
    while not pid_dead(pid):
        if time.monotonic() > deadline:
            logger.warning("zklock: child %s still alive; leaving its locks to its session timeout", pid)
            return 0
        time.sleep(0.005)
    zk = from_wire(settings)
    client = connect(zk)
    removed = 0
    try:
        for path in paths:
            try:
                children = client.get_children(path)
            except NoNodeError:
                continue
            pending = [(name, client.get_async(f"{path}/{name}")) for name in children]
            for name, result in pending:
                try:
                    owner = Identity.parse(result.get()[0])
                except NoNodeError:
                    continue
                if owner is not None and (owner.task_id, owner.pid, owner.host) == (task_id, pid, host):
                    try:
                        client.delete(f"{path}/{name}")
                        removed += 1
                    except NoNodeError:
                        pass
    finally:
        disconnect(client)
    return removed


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="[%(asctime)s: %(levelname)s/zklock-reaper] %(message)s")
    job = json.loads(sys.stdin.read())
    try:
        removed = reap_nodes(**job)
    except Exception as exc:  # the session timeout remains the bound
        logger.warning("could not release lost task %s's lock: %r", job.get("task_id"), exc)
        return 1
    if removed:
        logger.warning("released %d lock node(s) of task %s after its worker process %s died",
                       removed, job["task_id"], job["pid"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
