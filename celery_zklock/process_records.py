"""Who made a file: a process record, ``"<pid> <start time>"``, and whether it still runs.

Why a start time beside the pid: a pid alone may be reused by another process (small pids in
containers), and a worker's leftovers (its lock agent's socket directory, its metrics
directory) must be removed only once the process that made them is gone.  One module, read by
the worker's agent supervisor and by the metrics exporter (base layer: both may import it).
"""

from __future__ import annotations

import os


def process_record(pid: int | None = None) -> str:
    """``"<pid> <start time>"`` of a process (clock ticks since boot, ``-`` if unknown)."""
    pid = pid or os.getpid()
    return f"{pid} {start_time(pid) or '-'}"


def start_time(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def record_alive(record: str) -> bool:
    """Is the process a :func:`process_record` names alive?  When in doubt, yes."""
    try:
        pid_s, start = record.split()
        pid = int(pid_s)
    except ValueError:
        return True
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        pass
    now = start_time(pid)
    return start == "-" or now is None or now == start
