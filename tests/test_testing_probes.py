"""The test servers' ports: chosen where no outbound connection can take them while a
server is down (a killed ZooKeeper member restarts on the same election port)."""

from __future__ import annotations

import socket

from celery_zklock import testing_probes
from celery_zklock.testing_probes import free_port


def test_a_free_port_is_below_the_kernels_ephemeral_range_and_bindable():
    low = testing_probes._ephemeral_low()
    for _ in range(20):
        port = free_port()
        assert 1024 <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_an_outbound_connection_took_is_never_handed_out():
    """Why the range matters: a client's connection draws its local port from the
    ephemeral range; ``free_port`` never returns one of those."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        with socket.create_connection(server.getsockname()) as client:
            taken = client.getsockname()[1]
            assert taken >= testing_probes._ephemeral_low()
            assert all(free_port() != taken for _ in range(50))


def test_without_room_below_the_ephemeral_range_the_kernel_chooses(monkeypatch):
    monkeypatch.setattr(testing_probes, "_ephemeral_low", lambda: 1024)
    port = free_port()
    assert port >= 1024
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
