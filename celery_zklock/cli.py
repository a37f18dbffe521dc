"""``celery zklock``: inspect and operate locks from the command line.

Registered under Celery's ``celery.commands`` entry point, so it runs with the app's own
configuration: ``celery -A proj zklock status``.  Answers "who holds the lock?" (a common
request to the peers, celery-once #110) without a ZooKeeper shell.
"""

from __future__ import annotations

import json

import click
from kazoo.exceptions import NoAuthError
from celery.bin.base import CeleryCommand

# Celery imports this module for every `celery` command (the celery.commands entry point),
# so this is where `zklock_tasks` reaches a worker whose code never imports celery_zklock.
from . import task  # noqa: F401
from .client import connect, disconnect
from .errors import LockUnavailable
from .config import load_settings
from .keys import encode_key, key_path
from .lock import contenders
from .znodes import no_auth_error


def _client(settings):
    try:
        return connect(settings)
    except LockUnavailable as exc:
        raise click.ClickException(str(exc)) from None


@click.group(cls=click.Group, name="zklock")
@click.pass_context
def zklock(ctx: click.Context) -> None:
    """Inspect celery-zklock locks (holders, waiters, znode paths)."""


@zklock.command(cls=CeleryCommand)
@click.argument("key", required=False)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def status(ctx: click.Context, key: str | None, as_json: bool) -> None:
    """Holders and waiters of KEY, or of every key with contenders."""
    app = ctx.obj.app
    settings = load_settings(app.conf)
    client = _client(settings)
    try:
        _status(client, settings, key, as_json)
    except NoAuthError:
        raise click.ClickException(str(no_auth_error(settings.root, "reading the lock queues"))) from None
    finally:
        disconnect(client)


def _status(client, settings, key: str | None, as_json: bool) -> None:
    """Print the holders and waiters of KEY (or of every key) as text or JSON."""
    if key is not None:
        names = [encode_key(key)]
    else:
        names = sorted(client.get_children(settings.root)) if client.exists(settings.root) else []
    report = {}
    for name in names:
        path = f"{settings.root}/{name}"
        found = contenders(client, path)
        if found:
            report[path] = [{"node": c.node, "holder": c.holder, "owner": c.identifier} for c in found]
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    if not report:
        click.echo("no locks held or waited for")
    for path, rows in report.items():
        click.echo(path)
        for r in rows:
            click.echo(f"  {'HOLDS ' if r['holder'] else 'waits '} {r['node']}  {r['owner']}")


@zklock.command(cls=CeleryCommand)
@click.argument("key")
@click.pass_context
def path(ctx: click.Context, key: str) -> None:
    """Print the znode path of KEY (to share the lock with Curator or kazoo users)."""
    click.echo(key_path(load_settings(ctx.obj.app.conf).root, key))
