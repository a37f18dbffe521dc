"""What ``celery zklock status`` shows of the elected beats: each group's active scheduler and
standbys in queue order, and the last tick recorded per entry."""

from __future__ import annotations

import time
from urllib.parse import unquote

from kazoo.exceptions import NoNodeError

from ..engine.contenders import contenders
from ..engine.identity import Identity
from .rules import TickRecord
from .scheduler import folder


def beat_report(client, root: str) -> dict:
    """{group: {"beats": [...], "ticks": {...}}}: each elected beat group's active scheduler
    and standbys in queue order (host, pid, since), and the last tick recorded per entry."""
    base = folder(root)
    try:
        groups = sorted(client.get_children(base))
    except NoNodeError:
        return {}
    now = time.time()
    report = {}
    for g in groups:
        path = f"{base}/{g}"
        beats = []
        for position, c in enumerate(contenders(client, f"{path}/leader")):
            ident = Identity.parse(c.identifier)
            beats.append({"role": "active" if position == 0 else "standby", "position": position, "node": c.node,
                          "host": ident.host if ident else None, "pid": ident.pid if ident else None,
                          "since": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(c.created)) if c.created else None,
                          "for_s": round(now - c.created, 3) if c.created else 0.0})
        ticks = {}
        try:
            names = sorted(client.get_children(f"{path}/ticks"))
        except NoNodeError:
            names = []
        for n in names:
            try:
                record = TickRecord.parse(client.get(f"{path}/ticks/{n}")[0])
            except NoNodeError:
                continue
            if record is not None:
                ticks[unquote(n)] = {"seq": record.seq, "due": record.due.isoformat(), "state": record.state.value,
                                        "by": record.by, "token": record.token}
        report[unquote(g)] = {"beats": beats, "ticks": ticks}
    return report
