"""Who is queued on a lock path, in order: for ``celery zklock status`` and the agent's reports.

Read-only and separate from the lock: it reads any contender's node (ours, Curator's,
kazoo's) and needs no attempt, session monitor or ownership.
"""

from __future__ import annotations

from kazoo.client import KazooClient
from kazoo.exceptions import NoAuthError, NoNodeError

from . import znodes
from .identity import Identity
from .znodes import Contender


def contenders(client: KazooClient, path: str, max_holders: int | None = 1) -> list[Contender]:
    """Holders and waiters on ``path`` in queue order (any of our, Curator's or kazoo's nodes).

    ``max_holders=None``: as many holders as our nodes' data says the lock has (a
    semaphore's tasks record ``lock_max_holders``), else one — for readers such as
    ``celery zklock status`` that do not know the task."""
    try:
        ordered = znodes.sort_contenders(client.get_children(path))
    except NoNodeError:
        return []
    pending = [(name, client.get_async(f"{path}/{name}")) for name in ordered]
    found = []
    for name, result in pending:
        try:
            data, stat = result.get()
        except NoNodeError:
            continue
        except NoAuthError:  # a peer's node we may not read: it queues all the same
            stat = client.exists(f"{path}/{name}")  # not checked against ACLs
            if stat is None:
                continue
            data = b"(not readable with this client's credentials)"
        found.append((name, data.decode("utf-8", "replace"), stat.ctime / 1000.0))
    if max_holders is None:
        declared = [i.holders for _, data, _ in found if (i := Identity.parse(data)) is not None and i.holders]
        max_holders = max(declared) if declared else 1
    return [Contender(name, znodes.sequence_of(name) or 0, data, holds, created, znodes.is_shared(name))
            for (name, data, created), holds in zip(found, holding([name for name, _, _ in found], max_holders), strict=True)]


def holding(ordered: list[str], max_holders: int) -> list[bool]:
    """Which of the contenders (in queue order) hold, as the driver decides for each: a
    reader while no exclusive node queues ahead of it, an exclusive node within the first
    ``max_holders`` places.  Pure: table-tested."""
    out, exclusive_ahead = [], False
    for index, name in enumerate(ordered):
        if znodes.is_shared(name):
            out.append(not exclusive_ahead)
        else:
            out.append(index < max_holders)
            exclusive_ahead = True
    return out


def holders_async(client: KazooClient, path: str, max_holders: int, callback) -> None:
    """``callback(identifiers)`` of the holders of ``path``, read without blocking (``None``
    when they cannot be read; an empty list when nobody holds it).  Why not :func:`contenders`: the lock agent reports who
    held a key when a request timed out, and that report must never make the verdict wait
    for an unreachable ZooKeeper, nor cost a blocked thread per timeout."""
    from .kazoo_compat import on_all_ready, on_ready

    def listed(result) -> None:
        try:
            ordered = znodes.sort_contenders(result.get())
            names = [n for n, holds in zip(ordered, holding(ordered, max_holders), strict=True) if holds]
        except NoNodeError:
            names = []  # nobody queues on it any more
        except Exception:
            return callback(None)
        reads = [client.get_async(f"{path}/{name}") for name in names]

        def read() -> None:
            found = []
            for r in reads:
                try:
                    found.append(r.get(timeout=0)[0].decode("utf-8", "replace"))
                except Exception:
                    continue
            callback(found)

        on_all_ready(reads, read)

    if not client.connected:
        return callback(None)
    on_ready(client.get_children_async(path), listed)
