"""What ``celery zklock status`` shows of the elected beats: each group's active scheduler and
standbys in queue order, and the last tick recorded per entry."""

from __future__ import annotations

import json
import time
from urllib.parse import unquote

from kazoo.exceptions import NoNodeError

from ..engine.contenders import contenders
from ..engine.identity import Identity
from ..keys import encode_key
from .rules import TickRecord, TickState
from .scheduler import folder

#: A tick record still "sending" this long after its write: its beat is stuck in the publish.
STUCK_SENDING_S = 1.0


def _presence(client, path: str, ident) -> tuple[dict, float | None]:
    """A beat's presence node (written by the scheduler): its data, and its ctime (s): for a
    leader, when it began to lead (the node is made anew then)."""
    if ident is None:
        return {}, None
    try:
        data, stat = client.get(f"{path}/beats/{encode_key(f'{ident.host}:{ident.pid}')}")
        return json.loads(data or b"{}"), stat.ctime / 1000.0
    except (NoNodeError, ValueError):
        return {}, None


def beat_report(client, root: str) -> dict:
    """{group: {"beats": [...], "ticks": {...}}}: each elected beat group's active scheduler
    (since it began to lead) and standbys in queue order (their place in line, since they
    joined), and the last tick recorded per entry (with how long a tick has been "sending")."""
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
            presence, led_since = _presence(client, path, ident) if position == 0 else ({}, None)
            since = led_since if presence.get("leading") and led_since else c.created
            beats.append({"role": "active" if position == 0 else "standby", "position": position, "node": c.node,
                          "host": ident.host if ident else None, "pid": ident.pid if ident else None,
                          "since": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(since)) if since else None,
                          "for_s": round(now - since, 3) if since else 0.0,
                          "leading_since_known": bool(presence.get("leading") and led_since)})
        ticks = {}
        try:
            names = sorted(client.get_children(f"{path}/ticks"))
        except NoNodeError:
            names = []
        for n in names:
            try:
                data, stat = client.get(f"{path}/ticks/{n}")
            except NoNodeError:
                continue
            record = TickRecord.parse(data)
            if record is not None:
                age = max(0.0, now - stat.mtime / 1000.0)
                ticks[unquote(n)] = {"seq": record.seq, "due": record.due.isoformat(), "state": record.state.value,
                                     "by": record.by, "token": record.token, "for_s": round(age, 3),
                                     "stuck": record.state is TickState.SENDING and age > STUCK_SENDING_S}
        report[unquote(g)] = {"beats": beats, "ticks": ticks}
    return report
