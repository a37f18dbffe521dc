"""Is a ZooKeeper there, and which port is free: the small probes of the test servers.

Why apart: support scripts, benchmarks and tests ask a server for ``ruok``/``srvr``/``mntr``
or want a free loopback port without starting anything; and the servers of
:mod:`celery_zklock.testing_servers` wait on the same probes.  Standard library only.
"""

from __future__ import annotations

import random
import socket
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .testing_tls import TlsMaterial


#: The ephemeral range's first port when the kernel's cannot be read (Linux's default).
_EPHEMERAL_LOW_FALLBACK = 32768
#: Not the shared ``random`` state: a test that seeds it would make every pytest-xdist
#: worker try the same ports in the same order.
_random = random.SystemRandom()


def free_port() -> int:
    """A loopback TCP port that was free a moment ago, below the kernel's ephemeral range.

    Why not ``bind(0)``: that hands out a port from the ephemeral range, which every
    outbound connection on the machine also draws its local port from.  A server that is
    stopped and started again on its port (a killed ZooKeeper member, a restarted broker)
    could find it taken by some client's connection in between, and then cannot bind it: a
    ZooKeeper member without its election port still follows its leader but can never
    elect a new one (seen in CI: "ensemble did not regain a quorum" after a leader kill,
    under the parallel suite).  No connection ever takes a port below that range.
    """
    low = _ephemeral_low()
    start = 10000 if low > 12000 else 1024
    for _ in range(200 if low > start else 0):
        port = _random.randrange(start, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # a crowded range: the kernel's choice after all
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return _EPHEMERAL_LOW_FALLBACK


def four_letter_word(host: str, port: int, word: str, timeout: float = 1.0, tls: "TlsMaterial | None" = None) -> str:
    """Send a ZooKeeper four-letter command (``ruok``, ``srvr``, ``mntr``...) and return the
    reply (over TLS with a client certificate of ``tls`` for a TLS-only server)."""
    raw = socket.create_connection((host, port), timeout=timeout)
    if tls is not None:
        import ssl

        context = ssl.create_default_context(cafile=tls.ca)
        context.check_hostname = False
        context.load_cert_chain(tls.client_cert, tls.client_key)
        try:
            raw = context.wrap_socket(raw, server_hostname=host)
        except ssl.SSLError as exc:
            raw.close()
            raise OSError(f"TLS handshake failed: {exc}") from exc
    with raw as s:
        s.sendall(word.encode())
        chunks = []
        while True:
            data = s.recv(65536)
            if not data:
                break
            chunks.append(data)
    return b"".join(chunks).decode(errors="replace")


def is_reachable(hosts: str, timeout: float = 1.0) -> bool:
    """True when any server in a kazoo-style ``hosts`` string answers ``ruok`` with ``imok``."""
    for hp in hosts.split("/")[0].split(","):
        host, _, port = hp.strip().rpartition(":")
        try:
            if four_letter_word(host or "127.0.0.1", int(port or 2181), "ruok", timeout) == "imok":
                return True
        except (OSError, ValueError):
            continue
    return False
