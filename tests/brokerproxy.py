"""A loopback byte proxy in front of a broker (Redis or RabbitMQ) that can cut, stall and
black-hole its connections, for the tests of what the broker does to requests held aside.

Why not tests/tcpproxy.py: that one parses ZooKeeper's framing to lose one reply; a broker
fault needs only whole connections: :meth:`BrokerProxy.cut` closes every connection (the
client sees its connection reset, RabbitMQ requeues what that connection held unacked),
:meth:`BrokerProxy.outage` also refuses new ones for a while,
:meth:`BrokerProxy.lose_reply` passes a command on and loses its reply (the command ran, the
client sees its connection reset),
:meth:`BrokerProxy.stall` passes nothing either way and delivers what it buffered once
resumed (a stall that delivers late), and new connections pass as usual unless stalled.
"""

from __future__ import annotations

import socket
import threading

LOSE, HOLD = "lose", "hold"  # what becomes of a command's reply (BrokerProxy.lose_reply, hold_reply)


class _Pipe:
    def __init__(self, proxy: "BrokerProxy", client: socket.socket) -> None:
        self.proxy = proxy
        self.client = client
        self.server = socket.create_connection((proxy.host, proxy.port_to))
        self.closed = False
        self.gone = threading.Event()  # set by close(): a held reply waits for it
        self.reply_fate: str | None = None  # LOSE or HOLD: what becomes of the reply of a command passed on

    def start(self) -> None:
        for src, dst in ((self.client, self.server), (self.server, self.client)):
            threading.Thread(target=self._pump, args=(src, dst), daemon=True, name="broker-proxy").start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                self.proxy.flowing.wait()
                if self.closed:
                    break
                if src is self.server and self.reply_fate is not None:
                    if self.reply_fate == HOLD:
                        self.gone.wait()  # the reply waits here until the connection is cut
                    break  # and is lost with the connection: the command ran
                if src is self.client:
                    self.reply_fate = self.reply_fate or self.proxy.armed_for(data)
                dst.sendall(data)
        except OSError:
            pass
        self.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.gone.set()
        for s in (self.client, self.server):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        self.proxy.forget(self)


class BrokerProxy:
    """``127.0.0.1:<port>`` forwarding to ``host:port_to``."""

    def __init__(self, port_to: int, host: str = "127.0.0.1") -> None:
        self.host, self.port_to = host, port_to
        self.flowing = threading.Event()
        self.flowing.set()
        self._pipes: set[_Pipe] = set()
        self._guard = threading.Lock()
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port = self._listener.getsockname()[1]
        self.accepted = 0
        self.down = False
        self._armed: tuple[str, bytes] | None = None  # (fate, marker) for the next command carrying it
        self.replies = {LOSE: 0, HOLD: 0}
        threading.Thread(target=self._accept, daemon=True, name="broker-proxy-accept").start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self.down:  # the broker is "unreachable": the connection is refused at once
                client.close()
                continue
            try:
                pipe = _Pipe(self, client)
            except OSError:
                client.close()
                continue
            with self._guard:
                self._pipes.add(pipe)
                self.accepted += 1
            pipe.start()

    def lose_reply(self, marker: bytes) -> None:
        """The next command whose bytes contain ``marker`` (e.g. ``b"LPUSH"``) reaches the
        broker, which runs it; its reply is lost, the connection cut as it comes back."""
        self._arm(LOSE, marker)

    def hold_reply(self, marker: bytes) -> None:
        """The next command whose bytes contain ``marker`` reaches the broker, which runs it; its
        reply (and all after it on that connection) waits until :meth:`cut`: a client blocked
        on a command that ran."""
        self._arm(HOLD, marker)

    def _arm(self, fate: str, marker: bytes) -> None:
        with self._guard:
            self._armed = (fate, marker)

    def armed_for(self, data: bytes) -> str | None:
        """The armed fate, if ``data`` (a client's bytes) carries its marker: taken once."""
        with self._guard:
            if self._armed is None or self._armed[1] not in data:
                return None
            fate, self._armed = self._armed[0], None
            self.replies[fate] += 1
            return fate

    @property
    def replies_lost(self) -> int:
        return self.replies[LOSE]

    @property
    def replies_held(self) -> int:
        return self.replies[HOLD]

    def forget(self, pipe: _Pipe) -> None:
        with self._guard:
            self._pipes.discard(pipe)

    def cut(self) -> int:
        """Close every connection now; returns how many there were."""
        with self._guard:
            pipes = list(self._pipes)
        for pipe in pipes:
            pipe.close()
        return len(pipes)

    def outage(self, seconds: float) -> None:
        """Cut every connection and refuse new ones for ``seconds`` (in the background)."""
        self.down = True
        self.cut()
        threading.Timer(seconds, lambda: setattr(self, "down", False)).start()

    def stall(self) -> None:
        """Pass nothing either way (bytes wait in the proxy) until :meth:`resume`."""
        self.flowing.clear()

    def resume(self) -> None:
        self.flowing.set()

    def close(self) -> None:
        self.resume()
        self._listener.close()
        self.cut()

    def __enter__(self) -> "BrokerProxy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
