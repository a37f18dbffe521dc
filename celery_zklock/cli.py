"""``celery zklock``: inspect and operate locks from the command line.

Registered under Celery's ``celery.commands`` entry point, so it runs with the app's own
configuration: ``celery -A proj zklock status``.  Answers "who holds the lock?" (a common
request to the peers, celery-once #110) without a ZooKeeper shell, frees the lock of a
machine known to be dead, and streams lock events.  Every command takes ``--json``.
"""

from __future__ import annotations

import getpass
import json
import logging
import socket
import time
from typing import Any

import click
from celery.bin.base import CeleryCommand
from kazoo.exceptions import NoAuthError, NoNodeError

# Celery imports this module for every `celery` command (the celery.commands entry point),
# so this is where `zklock_tasks` reaches a worker whose code never imports celery_zklock.
from . import task as _hooks  # noqa: F401  (not `task`: a command's option has that name)
from .beat.status import beat_report
from .config import load_settings
from .engine import guard_counts, guards
from .engine.client import connect, disconnect
from .engine.identity import Identity
from .engine.lock import contenders
from .engine.znodes import no_auth_error
from .errors import LockUnavailable
from .keys import encode_key, key_path

logger = logging.getLogger("celery_zklock.cli")

#: The lock events workers send with ``-E`` (``task-lock-*``), as ``watch`` shows them.
LOCK_EVENTS = ("task-lock-waiting", "task-lock-acquired", "task-lock-released", "task-lock-timeout",
               "task-lock-lost", "task-lock-unavailable", "task-lock-duplicate", "task-lock-reentered",
               "task-lock-given-back")


def _client(settings):
    try:
        return connect(settings, summarize_retries=True)
    except LockUnavailable as exc:
        raise click.ClickException(str(exc)) from None


def _echo_json(value) -> None:
    click.echo(json.dumps(value, indent=2, sort_keys=True))


@click.group(cls=click.Group, name="zklock")
@click.pass_context
def zklock(ctx: click.Context) -> None:
    """Inspect and operate celery-zklock locks (holders, waiters, znode paths, events)."""


# ------------------------------------------------------------------ status
@zklock.command(cls=CeleryCommand)
@click.argument("key", required=False)
@click.option("--prefix", help="Only keys starting with this prefix.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def status(ctx: click.Context, key: str | None, prefix: str | None, as_json: bool) -> None:
    """Every holder and waiter of KEY, of the keys starting with --prefix, or of every key."""
    if key is not None and prefix is not None:
        raise click.UsageError("give KEY or --prefix, not both")
    settings = load_settings(ctx.obj.app.conf)
    client = _client(settings)
    try:
        report = lock_report(client, settings.root, key, prefix)
        guards_found = guard_report(client, settings.root, key, prefix)
        beats = beat_report(client, settings.root) if key is None and prefix is None else {}
    except NoAuthError:
        raise click.ClickException(str(no_auth_error(settings.root, "reading the lock queues"))) from None
    finally:
        disconnect(client)
    wanted = key_path(settings.root, key) if key is not None else f"{settings.root}/{encode_key(prefix) if prefix else ''}"
    add_local_waiters(report, {p: rows for p, rows in local_waiters(ctx.obj.app).items()
                               if (p == wanted if key is not None else p.startswith(wanted))})
    if as_json:
        return _echo_json({**report, **guards_found, **({"beat": beats} if beats else {})})
    if not report:
        click.echo("no locks held or waited for")
    _echo_beats(beats)
    _echo_guards(guards_found)
    for path, rows in report.items():
        click.echo(path)
        for r in rows:
            who = " ".join(f"{k}={r[k]}" for k in ("task", "task_id", "worker", "host", "pid") if r.get(k) is not None)
            what = "HOLDS" if r["holder"] else "waits"
            mode = r.get("mode", "")  # in-memory waiters: not known here
            where = r["node"] or "(in its worker: lock cohorting)"
            click.echo(f"  {r['position']:>3} {what} {mode:<5}  {r['for_s']:>8.1f}s  {where}  {who or r['data']}")


def _echo_beats(groups: dict) -> None:
    for group, found in groups.items():
        click.echo(f"celery beat group {group!r} (-S celery_zklock.beat:ZkScheduler)")
        for b in found["beats"]:
            what = "leads since" if b["role"] == "active" else f"#{b['position']} in line, joined"
            click.echo(f"  {b['role']:>7}  {b['host']} pid {b['pid']}  {what} {b['since']}  ({b['for_s']:.1f}s)  {b['node']}")
        for name, t in found["ticks"].items():
            stuck = f" for {t['for_s']:.1f}s: its beat looks stuck in the publish" if t.get("stuck") else ""
            click.echo(f"    tick {t['seq']} of {name!r} due {t['due']}: {t['state']} by {t['by']}{stuck}")


def _echo_guards(found: dict) -> None:
    for path, rows in found.items():
        g = rows[0]
        click.echo(f"{path}\n    enqueue guard ({g['guard']})  {g['for_s']:>8.1f}s  task={g['task']} task_id={g['task_id']}"
                   f"  stale in {g['expires_in_s']:.0f}s  deduped={g['deduped']}")


def local_waiters(app, timeout: float = 1.0) -> dict[str, list[dict]]:
    """{lock path: requests waiting for it inside workers}: a worker's agent queues one node
    per key in ZooKeeper and keeps the rest of its requests for that key in memory, so
    ZooKeeper alone does not show them; each worker answers ``zklock_waiting``."""
    merged: dict[str, list[dict]] = {}
    try:
        replies = app.control.broadcast("zklock_waiting", reply=True, timeout=timeout) or []
    except Exception as exc:  # no broker: ZooKeeper's view alone
        logger.warning("could not ask the workers for their waiting requests: %r", exc)
        return merged
    for reply in replies:
        for _worker, by_path in reply.items():
            if isinstance(by_path, dict):
                for path, rows in by_path.items():
                    merged.setdefault(path, []).extend(rows)
    return merged


def add_local_waiters(report: dict, waiting: dict[str, list[dict]]) -> dict:
    """Append workers' in-memory waiters to a :func:`lock_report`, after ZooKeeper's queue.
    A request that has a node of its own in ZooKeeper (a worker's node names the request it
    was made for) is listed there, once: not again among its worker's in-memory waiters."""
    for path, rows in waiting.items():
        queue = report.setdefault(path, [])
        listed = {r.get("task_id") for r in queue if r.get("task_id")}
        for row in sorted(rows, key=lambda r: -r["for_s"]):
            if row["task_id"] in listed:
                continue
            listed.add(row["task_id"])
            queue.append({"node": None, "position": len(queue), "holder": False, "for_s": row["for_s"],
                          "task": row["task"], "task_id": row["task_id"], "worker": row["worker"],
                          "host": None, "pid": row["pid"], "data": None})
    return report


def guard_report(client, root: str, key: str | None = None, prefix: str | None = None, task: str | None = None) -> dict:
    """{guard path: [guard]}: the enqueue guards (``lock_enqueue``) in place, each ``queued``
    (a persistent node: its message waits in the broker), ``publishing`` (not yet confirmed
    sent), ``running`` (an ephemeral node of the session running it,
    ``lock_enqueue_until="finish"``) or ``stale`` (a late confirm landed on another
    publisher's node: it names nobody), with its age and expiry;
    only those of ``task`` (a task name) when given."""
    base = guards.folder(root)
    names = []
    try:
        tasks = sorted(client.get_children(base))
    except NoNodeError:
        return {}
    for t in tasks:
        if task is not None and t != encode_key(task):
            continue
        try:
            keys = sorted(client.get_children(f"{base}/{t}"))
        except NoNodeError:
            continue
        names += [f"{t}/{k}" for k in keys if "#" not in k and (key is None or k == encode_key(key))
                  and (not prefix or k.startswith(encode_key(prefix)))]
    now = time.time()
    found = {}
    for name in names:
        try:
            raw, stat = client.get(f"{base}/{name}")
        except NoNodeError:
            continue
        g = guards.Guard.loads(raw)
        state = ("running" if stat.ephemeralOwner else "stale" if guards.misplaced(g, stat.czxid)
                 else "queued" if g is None or g.confirmed else "publishing")
        found[f"{base}/{name}"] = [{
            "node": name, "position": 0, "holder": False, "guard": state, "deduped": guards.dedupes(client, f"{base}/{name}"),
            "for_s": round(now - stat.ctime / 1000.0, 3), "task": g.task if g else None,
            "task_id": g.id if g else None, "expires_in_s": round(g.expires_at - now, 3) if g else 0.0,
            "until": g.until if g else None, "data": None if g else raw.decode("utf-8", "replace"),
        }]
    return found


def lock_report(client, root: str, key: str | None = None, prefix: str | None = None) -> dict:
    """{lock path: [contender, ...]} in queue order; each contender with its position, holder
    flag (every holder of a semaphore), age, and the task, worker, host and pid its node names."""
    if key is not None:
        names = [encode_key(key)]
    else:
        try:
            names = sorted(client.get_children(root))
        except NoNodeError:
            names = []
        if prefix is not None:
            start = encode_key(prefix) if prefix else ""
            names = [n for n in names if n.startswith(start)]
    now = time.time()
    report = {}
    for name in names:
        path = f"{root}/{name}"
        found = contenders(client, path, max_holders=None)
        if not found:
            continue
        rows = []
        for position, c in enumerate(found):
            ident = Identity.parse(c.identifier)
            rows.append({
                "node": c.node, "position": position, "holder": c.holder, "mode": "read" if c.reader else "write",
                "for_s": round(now - c.created, 3) if c.created else None,
                "task": ident.task if ident else None, "task_id": ident.task_id if ident else None,
                "worker": ident.worker if ident else None, "host": ident.host if ident else None,
                "pid": ident.pid if ident else None, "data": None if ident else c.identifier,
            })
        report[path] = rows
    return report


# ------------------------------------------------------------------ guards
@zklock.command("guards", cls=CeleryCommand)
@click.option("--task", "task_name", help="Only the guards of this task name.")
@click.option("--key", help="Only the guards of this lock key.")
@click.option("--clear", is_flag=True, help="Delete the guards (and their deduped counters), printing each.")
@click.option("--force", is_flag=True, help="With --clear: also delete running guards (their task is running now).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def guards_command(ctx: click.Context, task_name: str | None, key: str | None, clear: bool, force: bool,
                   as_json: bool) -> None:
    """List the enqueue guards (``lock_enqueue``), or delete them with --clear.

    After ``celery purge`` the guards of the purged messages stay until they expire
    (``zklock_enqueue_expires``), and publishes of their keys are deduped into tasks that no
    longer exist: ``--clear`` removes them.  A running guard (an ephemeral node: its task is
    running now, ``lock_enqueue_until="finish"``) is kept unless --force: its session ends it
    when the task ends, and deleting it lets a second run of the key be queued meanwhile."""
    if force and not clear:
        raise click.UsageError("--force only goes with --clear")
    settings = load_settings(ctx.obj.app.conf)
    client = _client(settings)
    removed, kept = [], []
    try:
        try:
            found = guard_report(client, settings.root, key=key, task=task_name)
            if clear:
                for path, rows in found.items():
                    g = rows[0]
                    if g["guard"] == "running" and not force:
                        kept.append(path)
                        continue
                    if _delete_guard(client, path, g["task_id"]):
                        removed.append(path)
        except NoAuthError:
            raise click.ClickException(str(no_auth_error(guards.folder(settings.root), "clearing enqueue guards"
                                                          if clear else "reading the enqueue guards"))) from None
    finally:
        disconnect(client)
    if not clear:
        if as_json:
            return _echo_json(found)
        if not found:
            click.echo("no enqueue guards")
        return _echo_guards(found)
    if as_json:
        _echo_json({"removed": removed, "kept": kept})
    else:
        for path in removed:
            g = found[path][0]
            click.echo(f"removed {path} ({g['guard']}, task={g['task']} task_id={g['task_id']}, deduped={g['deduped']})")
        if not removed:
            click.echo("no enqueue guards removed")
    for path in kept:
        g = found[path][0]
        click.echo(f"kept {path}: a running guard (task {g['task']} id {g['task_id']} is running now, and its "
                   f"worker's session ends the guard when it ends); deleting it lets a second run of the key be "
                   f"queued meanwhile: use --force for that", err=True)
    if kept:
        ctx.exit(1)


def _delete_guard(client, path: str, task_id: str | None) -> bool:
    """Delete the guard at ``path`` if it still names ``task_id`` (the one listed), and its
    deduped counter; False if it went or changed meanwhile (its task started, a new publish)."""
    from kazoo.exceptions import BadVersionError

    try:
        raw, stat = client.get(path)
        g = guards.Guard.loads(raw)
        if (g.id if g else None) != task_id:
            return False
        client.delete(path, version=stat.version)
    except (NoNodeError, BadVersionError):
        return False
    guard_counts.take(client, path, stat.czxid, timeout=10.0)
    return True


# ------------------------------------------------------------------ path
@zklock.command(cls=CeleryCommand)
@click.argument("key")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def path(ctx: click.Context, key: str, as_json: bool) -> None:
    """Print the znode path of KEY (to share the lock with Curator or kazoo users)."""
    value = key_path(load_settings(ctx.obj.app.conf).root, key)
    if as_json:
        return _echo_json({"key": key, "path": value})
    click.echo(value)


# ------------------------------------------------------------------ release
@zklock.command(cls=CeleryCommand)
@click.argument("key")
@click.option("--node", required=True, help="The exact node name to delete (see `status`).")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def release(ctx: click.Context, key: str, node: str, yes: bool, as_json: bool) -> None:
    """Force-delete one contender NODE of KEY: for an operator who knows its machine is dead.

    Deleting a live holder's node lets the next task in while it still runs: its release
    will fail with LockLost, and whatever it writes after is no longer exclusive.  So this
    deletes exactly the named node, after showing who it belongs to, and never guesses."""
    settings = load_settings(ctx.obj.app.conf)
    client = _client(settings)
    try:
        report = lock_report(client, settings.root, key)
        rows: list[dict[str, Any]] = next(iter(report.values()), [])
        row = next((r for r in rows if r["node"] == node), None)
        lock = key_path(settings.root, key)
        if row is None:
            known = ", ".join(r["node"] for r in rows) or "none"
            raise click.ClickException(f"no node {node!r} under {lock} (its contenders: {known}); nothing deleted")
        owner = " ".join(f"{k}={row[k]}" for k in ("task", "task_id", "worker", "host", "pid") if row.get(k) is not None)
        if not yes and not as_json:
            click.confirm(f"delete {lock}/{node} ({'HOLDS' if row['holder'] else 'waits'}; {owner or row['data']})?",
                          abort=True)
        elif not yes:
            raise click.UsageError("--json needs --yes (no prompt in machine-readable mode)")
        who = f"{getpass.getuser()}@{socket.gethostname()}"
        try:
            client.delete(f"{lock}/{node}")
        except NoNodeError:
            raise click.ClickException(f"{lock}/{node} went away meanwhile; nothing deleted") from None
        except NoAuthError:
            raise click.ClickException(str(no_auth_error(lock, "deleting a lock node"))) from None
        audit = f"celery-zklock: {who} force-deleted lock node {lock}/{node} ({owner or row['data']})"
        logger.warning(audit)  # into the operator's logging, when configured
        click.echo(audit, err=True)  # and always on stderr
    finally:
        disconnect(client)
    result = {"deleted": f"{lock}/{node}", "was_holder": row["holder"], "owner": row, "by": who}
    if as_json:
        return _echo_json(result)
    click.echo(f"deleted {lock}/{node} (by {who})")


# ------------------------------------------------------------------ watch
@zklock.command(cls=CeleryCommand)
@click.option("--prefix", default="", help="Only events of keys starting with this prefix.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@click.option("--limit", type=int, default=0, help="Stop after this many events (0: run until Ctrl-C).")
@click.option("--timeout", type=float, default=None, help="Stop after this many seconds.")
@click.pass_context
def watch(ctx: click.Context, prefix: str, as_json: bool, limit: int, timeout: float | None) -> None:
    """Stream lock events (waiting, acquired, released, timeout, lost...) of workers started
    with -E (task events on), for keys starting with --prefix."""
    app = ctx.obj.app
    seen = [0]

    def on_event(event: dict) -> None:
        if event.get("type") not in LOCK_EVENTS:
            return
        keys = event.get("key")
        keys = keys if isinstance(keys, list) else [keys]
        if prefix and not any(isinstance(k, str) and k.startswith(prefix) for k in keys):
            return
        seen[0] += 1
        if as_json:
            click.echo(json.dumps(event, sort_keys=True, default=str))
        else:
            extra = " ".join(f"{k}={event[k]}" for k in ("token", "wait", "held", "position", "policy", "reason", "error")
                             if event.get(k) is not None)
            click.echo(f"{time.strftime('%H:%M:%S', time.localtime(event.get('timestamp', time.time())))} "
                       f"{event['type'][10:]:<11} {event.get('key')}  {event.get('uuid')}  {event.get('hostname')}  {extra}")
        if limit and seen[0] >= limit:
            raise KeyboardInterrupt

    with app.connection_for_read() as conn:
        receiver = app.events.Receiver(conn, handlers={"*": on_event})
        try:
            receiver.capture(limit=None, timeout=timeout, wakeup=True)
        except (KeyboardInterrupt, socket.timeout, TimeoutError):
            pass
