"""Tasks of the container tests.  pytest-celery copies this file into the worker containers
(as ``tests/docker/tasks.py``), so it imports nothing from the test suite."""
import socket
import time

from celery import shared_task

from celery_zklock import ZkLockedTask, current_lock


def _run(seconds: float) -> dict:
    start = time.time()
    token = current_lock().token
    # Short sleeps, not one: on_lock_lost="interrupt" lands at the next Python bytecode,
    # never inside a C call such as one long time.sleep().
    while time.time() < start + seconds:
        time.sleep(0.05)
    return {"start": start, "end": time.time(), "token": token, "host": socket.gethostname()}


@shared_task(base=ZkLockedTask, lock_key="hot:{key}", lock_timeout=120)
def hold(key: str, seconds: float) -> dict:
    """Serialized per key: the record says when it ran, where, and with which fencing token."""
    return _run(seconds)


@shared_task(base=ZkLockedTask, lock_key="hot:{key}", lock_timeout=0.5, on_lock_timeout="skip")
def hold_or_skip(key: str, seconds: float) -> dict:
    return _run(seconds)


@shared_task(base=ZkLockedTask, lock_key="lost:{key}", lock_timeout=30, on_lock_lost="fail")
def hold_fail_on_lost(key: str, seconds: float) -> dict:
    return _run(seconds)


@shared_task(base=ZkLockedTask, lock_key="lost:{key}", lock_timeout=30, on_lock_lost="interrupt")
def hold_interrupt_on_lost(key: str, seconds: float) -> dict:
    return _run(seconds)
