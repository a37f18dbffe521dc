"""A loopback TCP proxy that understands just enough of ZooKeeper's framing to lose replies.

Fault tests put it between a kazoo client and a real ZooKeeper server to produce, on
demand, the network failures a lock must survive:

* :meth:`TcpProxy.arm_cut` — the next request of a given opcode (e.g. ``create``) reaches
  the server, which executes it, but the connection is cut before the reply gets back:
  the client sees ConnectionLoss for a request that *succeeded* (the "ghost node" case).
  With ``forward=False`` the request is dropped instead, so the server never sees it;
  with ``deliver_reply=True`` the reply gets through and the cut follows right after it
  (the client learns the result and is SUSPENDED the next instant).
* :meth:`TcpProxy.hold` / :meth:`TcpProxy.release_held` — drop every connection and keep
  new ones waiting (accepted, not yet connected upstream) until released: the client is
  SUSPENDED for exactly as long as the test wants, then reconnects on the same session.
* :meth:`TcpProxy.drop_all` — close every proxied connection at once.
* :meth:`TcpProxy.blackhole` — keep every connection open and pass nothing either way: a
  silent partition (a dropping firewall, a dead switch), which no socket error reveals.

Every frame on a ZooKeeper connection is length-prefixed (4-byte big-endian).  The first
frame in each direction is the session handshake (ConnectRequest / ConnectResponse); every
later client frame starts with ``xid:int32, type:int32`` and every server frame with
``xid:int32, zxid:int64, err:int32``.  Nothing else is parsed.
"""

from __future__ import annotations

import socket
import struct
import threading

__all__ = [
    "TcpProxy",
    "OP_CREATE",
    "OP_CREATE2",
    "OP_DELETE",
    "OP_EXISTS",
    "OP_GET_CHILDREN",
    "OP_GET_CHILDREN2",
    "OP_MULTI",
    "OP_PING",
]

OP_CREATE = 1
OP_DELETE = 2
OP_EXISTS = 3
OP_GET_CHILDREN = 8
OP_GET_CHILDREN2 = 12
OP_PING = 11
OP_MULTI = 14
OP_CREATE2 = 15


def _frames(buf: bytearray):
    """Pop complete length-prefixed frames off ``buf``."""
    out = []
    while len(buf) >= 4:
        (n,) = struct.unpack_from(">i", buf, 0)
        if n < 0 or len(buf) < 4 + n:
            break
        out.append(bytes(buf[: 4 + n]))
        del buf[: 4 + n]
    return out


class _Conn:
    def __init__(self, proxy: "TcpProxy", client: socket.socket) -> None:
        self.proxy = proxy
        self.client = client
        self.server: socket.socket | None = None
        self.cut_xid: int | None = None  # set once a cut fired on this connection
        self.closed = False
        self._lock = threading.Lock()

    # -------------------------------------------------------------- lifecycle
    def start(self) -> None:
        try:
            self.server = socket.create_connection((self.proxy.target_host, self.proxy.target_port), timeout=5)
            self.server.settimeout(None)
        except OSError:
            self.close()
            return
        threading.Thread(target=self._c2s, daemon=True, name="proxy-c2s").start()
        threading.Thread(target=self._s2c, daemon=True, name="proxy-s2c").start()

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
        for s in (self.client, self.server):
            if s is None:
                continue
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            try:
                s.close()
            except OSError:
                pass
        self.proxy._forget(self)

    # -------------------------------------------------------------- pumps
    def _c2s(self) -> None:
        buf = bytearray()
        first = True
        try:
            while not self.closed:
                data = self.client.recv(65536)
                if not data:
                    break
                if self.cut_xid is not None or self.proxy._silent:
                    continue  # after a cut (or in a black hole) nothing more reaches the server
                buf += data
                out = bytearray()
                for frame in _frames(buf):
                    if first:
                        first = False
                        out += frame
                        continue
                    xid, op = struct.unpack_from(">ii", frame, 4)
                    cut = self.proxy._take_cut(op)
                    if cut is None:
                        out += frame
                        continue
                    # The armed request: everything before it goes through, then it is
                    # either forwarded (and its reply swallowed) or dropped, and the
                    # connection is cut.
                    self.cut_xid = xid
                    if cut.forward:
                        out += frame
                    self.server.sendall(bytes(out))
                    out.clear()
                    cut.request_seen.set()
                    if not cut.forward:
                        if cut.then_hold:
                            self.proxy._set_holding()
                        cut.fired.set()
                        self.close()
                        return
                    # Wait (bounded) for the server's reply in _s2c, which then closes.
                    if not cut.fired.wait(5):
                        self.close()
                    return
                if out:
                    self.server.sendall(bytes(out))
        except OSError:
            pass
        self.close()

    def _s2c(self) -> None:
        buf = bytearray()
        first = True
        try:
            while not self.closed:
                data = self.server.recv(65536)
                if not data:
                    break
                if self.proxy._silent:
                    continue  # a black hole: the reply is lost, and the socket stays open
                buf += data
                out = bytearray()
                for frame in _frames(buf):
                    if first:
                        first = False
                        out += frame
                        continue
                    cut_xid = self.cut_xid
                    if cut_xid is None:
                        out += frame
                        continue
                    cut = self.proxy._fired_cut
                    xid, zxid, err = struct.unpack_from(">iqi", frame, 4)
                    if xid != cut_xid:
                        # Replies to earlier requests and watch events: they flow on only
                        # when the armed reply itself is to be delivered.
                        if cut is not None and cut.deliver_reply:
                            out += frame
                        continue
                    # The armed request's reply: deliver or swallow it, then cut.
                    if cut is not None:
                        cut.reply_err = err
                        cut.reply_zxid = zxid
                        if cut.deliver_reply:
                            out += frame
                            self.client.sendall(bytes(out))
                        if cut.then_hold:
                            self.proxy._set_holding()
                        cut.fired.set()
                    self.close()
                    return
                if out:
                    self.client.sendall(bytes(out))
        except OSError:
            pass
        self.close()


class _Cut:
    def __init__(self, opcodes: frozenset[int], forward: bool, deliver_reply: bool, then_hold: bool) -> None:
        self.opcodes = opcodes
        self.forward = forward
        self.deliver_reply = deliver_reply
        self.then_hold = then_hold
        self.request_seen = threading.Event()
        self.fired = threading.Event()
        self.reply_err: int | None = None  # server's error code for the swallowed reply (0 = ok)
        self.reply_zxid: int | None = None


class TcpProxy:
    """Thread-based proxy from ``127.0.0.1:<port>`` to ``target_host:target_port``."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target_host = target_host
        self.target_port = target_port
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port = self._listener.getsockname()[1]
        self._conns: set[_Conn] = set()
        self._pending: list[socket.socket] = []
        self._holding = False
        self._silent = False  # a black hole: connections stay open, nothing passes
        self._guard = threading.Lock()
        self._cut: _Cut | None = None
        self._fired_cut: _Cut | None = None
        self._stopped = False
        self.accepted = 0
        self._thread = threading.Thread(target=self._accept_loop, daemon=True, name="proxy-accept")
        self._thread.start()

    @classmethod
    def to(cls, hosts: str) -> "TcpProxy":
        """Proxy to the first ``host:port`` of a kazoo ``hosts`` string."""
        host, _, port = hosts.split(",")[0].rpartition(":")
        return cls(host or "127.0.0.1", int(port))

    @property
    def hosts(self) -> str:
        return f"127.0.0.1:{self.port}"

    # -------------------------------------------------------------- fault controls
    def arm_cut(
        self, opcodes=(OP_CREATE, OP_CREATE2), forward: bool = True, deliver_reply: bool = False, then_hold: bool = False
    ) -> _Cut:
        """Cut the connection at the next request whose opcode is in ``opcodes``.

        ``forward=True``: the request reaches the server; its reply (and anything after
        it) is swallowed and the connection closed once the reply arrived, so the server
        has certainly executed it.  ``forward=False``: the request is dropped and the
        connection closed at once.  ``deliver_reply=True``: the reply (and the replies
        before it) still reaches the client and the connection is closed right after it.
        ``then_hold=True``: at the cut the proxy starts holding new connections (see
        :meth:`hold`) until :meth:`release_held`.  Returns a handle whose ``fired`` event
        is set when the cut happened and whose ``reply_err`` / ``reply_zxid`` are the
        server's error code and zxid for the request.
        """
        cut = _Cut(frozenset(opcodes), forward, deliver_reply and forward, then_hold)
        with self._guard:
            self._cut = cut
        return cut

    def _take_cut(self, op: int) -> _Cut | None:
        with self._guard:
            cut = self._cut
            if cut is None or op not in cut.opcodes:
                return None
            self._cut = None
            self._fired_cut = cut
            return cut

    def _set_holding(self) -> None:
        with self._guard:
            self._holding = True

    def drop_all(self) -> None:
        """Close every proxied connection now."""
        with self._guard:
            conns = list(self._conns)
        for c in conns:
            c.close()

    def hold(self) -> None:
        """Drop every connection and park new ones (accepted, not forwarded) until released."""
        with self._guard:
            self._holding = True
        self.drop_all()

    def blackhole(self, on: bool = True) -> None:
        """Pass nothing either way, and close nothing: a silent partition."""
        self._silent = on

    def release_held(self) -> None:
        """Stop holding: parked and future connections are forwarded to the server."""
        with self._guard:
            self._holding = False
            pending, self._pending = self._pending, []
        for s in pending:
            self._serve(s)

    def connection_count(self) -> int:
        with self._guard:
            return len(self._conns)

    def close(self) -> None:
        self._stopped = True
        try:
            self._listener.close()
        except OSError:
            pass
        with self._guard:
            pending, self._pending = self._pending, []
        for s in pending:
            s.close()
        self.drop_all()

    def __enter__(self) -> "TcpProxy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -------------------------------------------------------------- internals
    def _accept_loop(self) -> None:
        while not self._stopped:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            self.accepted += 1
            with self._guard:
                if self._holding:
                    self._pending.append(sock)
                    continue
            self._serve(sock)

    def _serve(self, sock: socket.socket) -> None:
        conn = _Conn(self, sock)
        with self._guard:
            self._conns.add(conn)
        conn.start()

    def _forget(self, conn: _Conn) -> None:
        with self._guard:
            self._conns.discard(conn)
