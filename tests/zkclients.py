"""Kazoo clients a test makes beyond the ``zk_client`` fixture: one through a
:class:`~tests.tcpproxy.TcpProxy` (the proxy cuts it, stalls it, drops its replies) and a pair
for a chroot."""

from __future__ import annotations

import contextlib

from kazoo.client import KazooClient

from tests.tcpproxy import TcpProxy


def proxied_client(proxy: TcpProxy) -> KazooClient:
    """A started client through ``proxy`` that reconnects at once when the proxy lets it."""
    client = KazooClient(hosts=proxy.hosts, timeout=10.0,
                         connection_retry={"max_tries": -1, "delay": 0.05, "max_delay": 0.2})
    client.start(timeout=30)
    return client


@contextlib.contextmanager
def chrooted(zk_server, chroot: str):
    """``(root, client)``: a client of the whole tree and one chrooted at ``chroot`` (made)."""
    root = KazooClient(hosts=zk_server.hosts)
    root.start()
    root.ensure_path(chroot)
    client = KazooClient(hosts=zk_server.hosts + chroot)
    client.start()
    try:
        yield root, client
    finally:
        client.stop()
        client.close()
        root.stop()
        root.close()
