"""The wire between a worker's lock agent and its main and pool processes: the protocol.

Three processes speak it: the agent (:mod:`celery_zklock.worker.agent`), the worker's main
process (:mod:`celery_zklock.worker.wait_outside_pool`) and each pool process
(:mod:`celery_zklock.worker.agent_client`).  Read top to bottom:

* **Messages.**  Each is one frozen dataclass below, and its docstring says who sends it,
  when, and what answers it.
* **Encoding.**  A message is one JSON object (:func:`encode`): ``op`` names its class, and
  each field goes as itself, left out at its default; enums go as their values.  A line that
  is no message of this protocol (an unknown ``op``, a field missing, unknown or of the wrong
  type) is refused by :func:`decode` with a :class:`ProtocolError`.
* **Framing.**  One message per line on a Unix stream socket (:class:`LineReader`: a line
  that is no message is logged and skipped; :class:`Connection`: whole lines sent, and the
  agent's sends never block).  The socket sits in a directory private to the worker
  (:func:`socket_path`; pool processes find it through :data:`ENV`), and it is what makes
  worker loss fast: when a pool process dies, the kernel closes its end, and the agent
  releases what that process held at once (no pid polling, no reaper process).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import os
import socket
import tempfile
import threading
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Protocol, TypeVar, Union

from ..engine.tick_fence import Fenced

logger = logging.getLogger("celery_zklock.worker")

#: The ``delivery_info`` field in which a grant travels with its task from the main process
#: to the pool process (:class:`Decided`'s ``carry``, in its wire form: ``delivery_info`` is
#: plain data that ``celery inspect`` sends as JSON).
CARRIED = "zklock_grant"

#: The ``delivery_info`` field that marks a delivery whose task id the agent knows by another
#: delivery (one held aside already, or told :class:`Bypass`): its pool process must not claim
#: the agent's request for that id, which is the other delivery's (both would run on its
#: grant), and locks in-process instead.
BYPASSED = "zklock_bypassed"

#: Seconds between the agent's heartbeats (:class:`Ping`).
HEARTBEAT = 0.2

#: A request next in line is handed to a pool process before its grant only if locks on
#: its path (or of its task) have been held at most this long on average (seconds): that
#: process idles until the holder releases (:class:`Next`).
HANDOFF_MAX_WAIT = 0.5


class Verdict(str, enum.Enum):
    """A request's one verdict: :class:`Decided`'s to the main process, :class:`Claimed`'s to
    the pool process.  The value is the wire encoding (JSON strings)."""

    GRANTED = "granted"
    TIMEOUT = "timeout"
    UNAVAILABLE = "unavailable"
    REVOKED = "revoked"
    SHUTDOWN = "shutdown"


class ClaimAnswer(str, enum.Enum):
    """A claim's answer when no verdict can be told (yet), in place of one."""

    PENDING = "pending"  # next in line: the verdict follows when decided
    UNKNOWN = "unknown"  # nothing to claim: the pool process locks in-process


class Cancel(str, enum.Enum):
    """Why the main process stops waiting for a request (:class:`StopWaiting`, and
    :class:`Finished` as the agent reads it)."""

    REVOKED = "revoked"
    SHUTDOWN = "shutdown"
    FINISHED = "finished"  # the pool is done with it without claiming it


class PeerRole(str, enum.Enum):
    """Who connects to the agent (:class:`Hello`)."""

    MAIN = "main"
    POOL = "pool"


class ProtocolError(ValueError):
    """A line or value that is not a message of this protocol."""


class Message(Protocol):
    """What every message class declares: its wire ``op``, set by :func:`message`."""

    op: ClassVar[str]


_M = TypeVar("_M", bound=Message)
_BY_OP: dict[str, type[Message]] = {}


def message(op: str) -> Callable[[type[_M]], type[_M]]:
    """Register a frozen dataclass as the message whose wire ``op`` is ``op``."""

    def register(cls: type[_M]) -> type[_M]:
        if op in _BY_OP:
            raise TypeError(f"two messages share the op {op!r}")
        cls.op = op
        _BY_OP[op] = cls
        return cls

    return register


# ---------------------------------------------------------------------- everyone
@message("hello")
@dataclass(frozen=True)
class Hello:
    """Main or pool process -> agent, first on a new connection: who it is.  No answer.  The
    agent exits once its main process has gone (and no pool process holds a lock through it)."""

    op: ClassVar[str]
    role: PeerRole
    pid: int | None = None


@message("ping")
@dataclass(frozen=True)
class Ping:
    """Agent -> everyone, every :data:`HEARTBEAT` seconds while its event thread makes progress.
    No answer.  Silence means the agent is frozen or gone: the main process kills and restarts
    it, and a pool process stops trusting the locks it holds through it."""

    op: ClassVar[str]


# ---------------------------------------------------------------------- main process -> agent
@message("wait")
@dataclass(frozen=True)
class Wait:
    """Main -> agent: queue for a locked request's locks (``paths``, taken in canonical order,
    all or nothing).  Answered later by one :class:`Decided`, after :class:`Queued` if it has to
    wait (only when ``watched``: the main process reads it for events, LOCK_WAITING, metrics, or
    its prefetch window), and, with ``early``, :class:`Next` when only holders are ahead of it.
    A task id the agent already waits for or holds is answered :class:`Bypass` instead.

    ``seq`` numbers the delivery (a task id can come again); ``read``: the paths it reads
    (``lock_mode``), with at most ``readers`` read nodes of ours per path (the pool's size)."""

    op: ClassVar[str]
    id: str
    paths: tuple[str, ...]
    seq: int | None = None
    task: str = ""
    max_holders: int = 1
    timeout: float | None = None  # seconds; None: no deadline
    identity: str = ""  # what our node's data names (engine.identity)
    early: bool = False  # the main process may hand it to the pool while next in line
    guard: dict | None = None  # its enqueue guard header (lock_enqueue)
    watched: bool = True
    read: tuple[str, ...] = ()
    readers: int = 1


@message("cancel")
@dataclass(frozen=True)
class StopWaiting:
    """Main -> agent: stop waiting for a request, ``revoked`` or at a ``shutdown``.  No answer,
    except for one the main process already handed to the pool as next in line (``in_pool``):
    still undecided, it gets that verdict instead, and the main process hears :class:`Decided`
    (``revoked``) back."""

    op: ClassVar[str]
    id: str
    why: Cancel
    in_pool: bool = False


@dataclass(frozen=True)
class _Deliveries:
    """The deliveries a :class:`Finished` or :class:`Dropped` names: ``seqs`` are the ``seq`` of
    their :class:`Wait` (a task id can wait again, a retry with no countdown, once its first
    delivery let go, and the first's end must not end it); without them, whichever waits."""

    ids: tuple[str, ...]
    seqs: tuple[int | None, ...] | None = None

    def deliveries(self) -> list[tuple[str, int | None]]:
        """(id, seq) of each delivery named (seq None: whichever waits)."""
        seqs = self.seqs if self.seqs is not None else [None] * len(self.ids)
        return list(zip(self.ids, seqs, strict=False))  # off the wire: a short seqs names fewer deliveries


@message("finished")
@dataclass(frozen=True)
class Finished(_Deliveries):
    """Main -> agent, at most once per turn of its event loop: the pool is done with these
    deliveries.  The agent lets go of any grant nobody claimed.  No answer."""

    op: ClassVar[str]


@message("dropped")
@dataclass(frozen=True)
class Dropped(_Deliveries):
    """Main -> agent: Celery dropped these handed-over deliveries unrun (its close at a broker
    reconnection or shutdown; their messages come back from the broker).  The agent lets go of
    each one no pool process claims (a carried grant once it can no longer be started on).
    No answer."""

    op: ClassVar[str]


@message("fence")
@dataclass(frozen=True)
class Fence:
    """Main -> agent: a tick of the elected beat reached the worker; may its body run
    (:mod:`celery_zklock.engine.tick_fence`)?  ``id`` names the tick held in the main process.
    Answered by :class:`FenceAnswer`."""

    op: ClassVar[str]
    id: str
    path: str
    seq: int
    token: int | None = None


@message("unguard")
@dataclass(frozen=True)
class Unguard:
    """Main -> agent: end the enqueue guard of a request the worker discarded unrun (revoked,
    expired).  No answer."""

    op: ClassVar[str]
    id: str
    paths: tuple[str, ...]
    retries: int = 0


# ---------------------------------------------------------------------- agent -> main process
@dataclass(frozen=True)
class Carry:
    """A grant made on a young proof of every node (the lease), which travels with its task:
    the main process puts it in the request it hands to the pool (:data:`CARRIED`), and the
    pool process starts on it while ``proof`` (lease clock) is younger than the lease window,
    claiming with :class:`Claim` ``carried``."""

    proof: float
    session_timeout: float  # the agent's session, as negotiated
    waited: float | None
    tokens: dict[str, int]

    def as_claimed(self, request_id: str) -> "Claimed":
        """The claim's answer this grant stands for: granted, held as of its proof."""
        return Claimed(request_id, Verdict.GRANTED, waited=self.waited, tokens=self.tokens,
                       held=True, session_timeout=self.session_timeout, carried=True)


@message("decided")
@dataclass(frozen=True)
class Decided:
    """Agent -> main: a request's one verdict (for its :class:`Wait`, or a :class:`StopWaiting`
    ``in_pool``).  Granted or not, the main process hands the request to the pool, whose
    process claims the verdict (:class:`Claim`); ``revoked`` answers a revocation in the pool.
    ``queued``: it had to wait (its key is contended: it jumps the pool's queue); ``error``:
    why ``unavailable``; ``carry``: the grant itself, when a young lease covers it.  No answer."""

    op: ClassVar[str]
    id: str
    verdict: Verdict
    seq: int | None = None
    queued: bool = False
    error: str | None = None
    carry: Carry | None = None


@message("queued")
@dataclass(frozen=True)
class Queued:
    """Agent -> main, once per watched :class:`Wait` that has to wait behind a holder: its
    ``position`` in the local queue.  No answer."""

    op: ClassVar[str]
    id: str
    position: int
    seq: int | None = None


@message("next")
@dataclass(frozen=True)
class Next:
    """Agent -> main, for a :class:`Wait` with ``early``, at most once: only holders are ahead
    of it.  ``hold``: how long locks on its path (or of its task) have been held on average, or
    None; ``ours``: the holder is a request of this worker's whose release passes the node on,
    not another contender's node in ZooKeeper.  No answer: the main process may hand it to the
    pool now, where it claims (and is told ``pending``)."""

    op: ClassVar[str]
    id: str
    seq: int | None = None
    hold: float | None = None
    ours: bool = True


@message("bypass")
@dataclass(frozen=True)
class Bypass:
    """Agent -> main, for a :class:`Wait` whose task id already waits or runs through the agent
    (a retry published by a body still holding its lock, a redelivery): hand it to the pool
    marked :data:`BYPASSED`; it locks in-process there, never claiming by its id.  No answer."""

    op: ClassVar[str]
    id: str
    seq: int | None = None


@message("fenced")
@dataclass(frozen=True)
class FenceAnswer:
    """Agent -> main, for a :class:`Fence`: may the tick run, or None with ``error`` when
    ZooKeeper did not answer.  No answer."""

    op: ClassVar[str]
    id: str
    verdict: Fenced | None = None
    error: str | None = None


# ---------------------------------------------------------------------- pool process <-> agent
@message("claim")
@dataclass(frozen=True)
class Claim:
    """Pool -> agent: "I run this request".  Answered by :class:`Claimed`, or first by
    :class:`Claimed` ``pending`` for a request next in line, whose verdict follows when decided;
    from then on the lock belongs to that connection.  ``carried``: "I run it on the grant it
    brought" (:class:`Carry`): not answered while the lock is held as that grant said,
    otherwise by :class:`LockState`; a plain claim after it (the grant aged before it was sent)
    is answered with the verdict."""

    op: ClassVar[str]
    id: str
    carried: bool = False


@message("unclaim")
@dataclass(frozen=True)
class Unclaim:
    """Pool -> agent: the claim's answer did not come in time (a busy agent) and the pool
    process locks in-process instead: the agent lets go of that request's locks, however it
    was answered meanwhile.  No answer."""

    op: ClassVar[str]
    id: str


@message("release")
@dataclass(frozen=True)
class Release:
    """Pool -> agent: let go of a claimed request's locks.  Answered by :class:`Released` (a
    pool process giving back a lock whose body never ran does not wait for it)."""

    op: ClassVar[str]
    id: str


@message("claimed")
@dataclass(frozen=True)
class Claimed:
    """Agent -> pool, for a :class:`Claim`: the verdict, or ``pending`` / ``unknown``
    (:class:`ClaimAnswer`: ``unknown``, no such request or one neither decided nor next in line,
    makes the pool process lock in-process).  With the verdict: ``waited`` (seconds), and
    ``holders`` for a timeout, ``error`` for ``unavailable``; for a grant, its ``tokens`` and
    ``nodes`` per path, the locks' state now (``held``, ``lost``, ``reason``: a grant made
    before ZooKeeper became unreachable says nothing of now) and the agent's negotiated
    ``session_timeout`` (the claimer trusts its silence for a third of it).  No answer.
    ``carried``: the answer a pool process made itself from the grant its task carried
    (:meth:`Carry.as_claimed`), started on without waiting for the agent's; never sent."""

    op: ClassVar[str]
    id: str
    verdict: Union[Verdict, ClaimAnswer]
    waited: float | None = None
    tokens: dict[str, int] | None = None
    nodes: dict[str, str] | None = None
    holders: list[str] | None = None
    error: str | None = None
    held: bool = False
    lost: bool = False
    reason: str | None = None
    session_timeout: float | None = None
    carried: bool = False


@message("state")
@dataclass(frozen=True)
class LockState:
    """Agent -> pool, pushed to a claimer: its locks became unsafe (suspended), safe again, or
    lost (also: a carried claim on a grant this agent does not hold).  No answer."""

    op: ClassVar[str]
    id: str
    held: bool
    lost: bool = False
    reason: str | None = None


@message("released")
@dataclass(frozen=True)
class Released:
    """Agent -> pool, for a :class:`Release`: ``proven`` when ZooKeeper (or the local handoff's
    write) proved every lock held to the end; ``reason`` when not.  No answer."""

    op: ClassVar[str]
    id: str
    proven: bool
    reason: str | None = None


# ---------------------------------------------------------------------- the encoding
def encode(msg) -> bytes:
    """One message as its wire line."""
    return json.dumps({"op": msg.op, **as_wire(msg)}, separators=(",", ":")).encode() + b"\n"


def decode(line: bytes | str):
    """The message of one wire line; :class:`ProtocolError` if it is none."""
    try:
        value = json.loads(line)
    except ValueError as exc:
        raise ProtocolError(f"not JSON: {line[:200]!r}") from exc
    if not isinstance(value, dict):
        raise ProtocolError(f"not a JSON object: {line[:200]!r}")
    fields = dict(value)
    op = fields.pop("op", None)
    cls = _BY_OP.get(op) if isinstance(op, str) else None
    if cls is None:
        raise ProtocolError(f"unknown op {op!r}")
    return from_wire(cls, fields)


def as_wire(obj) -> dict:
    """A message's (or a :class:`Carry`'s) fields as plain data, those at their default left out."""
    out = {}
    for name, default, _read, nested in _codec(type(obj)):
        value = getattr(obj, name)
        if value is default or (default is not _REQUIRED and value == default):
            continue
        out[name] = as_wire(value) if nested and value is not None else value
    return out


def from_wire(cls, fields: dict):
    """A message (or a :class:`Carry`) of class ``cls`` from its fields as plain data."""
    if not isinstance(fields, dict):
        raise ProtocolError(f"{cls.__name__}: not a JSON object: {fields!r}")
    codec = _codec(cls)
    unknown = fields.keys() - _NAMES[cls]
    if unknown:
        raise ProtocolError(f"{cls.__name__}: unknown field(s) {sorted(unknown)}")
    values = {}
    for name, default, read, _nested in codec:
        if name not in fields:
            if default is _REQUIRED:
                raise ProtocolError(f"{cls.__name__}: field {name!r} missing")
            continue
        try:
            values[name] = read(fields[name])
        except (TypeError, ValueError) as exc:
            raise ProtocolError(f"{cls.__name__}: field {name!r}: {exc}") from None
    return cls(**values)


_REQUIRED = object()
_CODECS: dict[type, list] = {}
_NAMES: dict[type, frozenset] = {}


def _codec(cls) -> list:
    """(name, default, reader, nested) per field of ``cls``, read once from its annotations."""
    codec = _CODECS.get(cls)
    if codec is None:
        hints = typing.get_type_hints(cls)
        codec = _CODECS[cls] = [
            (f.name, f.default if f.default is not dataclasses.MISSING else _REQUIRED, _reader(hints[f.name]),
             any(dataclasses.is_dataclass(t) for t in (hints[f.name], *typing.get_args(hints[f.name]))))
            for f in dataclasses.fields(cls)
        ]
        _NAMES[cls] = frozenset(name for name, *_ in codec)
    return codec


def _reader(tp) -> Callable[[Any], Any]:
    """A function that checks a wire value against the type ``tp`` and returns it as that type
    (JSON lists become tuples where a tuple is declared); TypeError or ValueError if it is not."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        readers = [_reader(a) for a in args if a is not type(None)]
        optional = type(None) in args
        if len(readers) == 1:  # X | None: X's own error says what is wrong
            [read] = readers
            return lambda value: None if value is None and optional else read(value)

        def union(value):
            if value is None and optional:
                return None
            for read in readers:
                try:
                    return read(value)
                except (TypeError, ValueError):
                    pass
            raise TypeError(f"{value!r} is not {tp}")

        return union
    if origin is tuple:
        item = _reader(args[0])
        return lambda value: tuple(item(v) for v in _of(value, list))
    if origin is list:
        item = _reader(args[0])
        return lambda value: [item(v) for v in _of(value, list)]
    if origin is dict:
        key, item = _reader(args[0]), _reader(args[1])
        return lambda value: {key(k): item(v) for k, v in _of(value, dict).items()}
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return tp
    if dataclasses.is_dataclass(tp):
        return lambda value: from_wire(tp, value)
    if tp is float:
        return lambda value: _of(value, (int, float))
    if tp in (str, int, bool, dict):
        return lambda value: _of(value, tp)
    raise TypeError(f"no wire reader for {tp}")


def _of(value, kind):
    """``value`` if it is of ``kind`` (a bool is no number here), else TypeError."""
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise TypeError(f"{value!r} is not {getattr(kind, '__name__', kind)}")
    return value


# ---------------------------------------------------------------------- the framing: lines on a Unix socket
#: Environment variable that tells pool processes where their worker's agent listens.
ENV = "CELERY_ZKLOCK_AGENT"

#: The agent's private directory: its name's start, its socket's name, and beside the socket
#: the record (process_records) of the worker's main process that made it, so that a later
#: start tells a dead worker's directory from a live one's (the agent removes it as it exits).
AGENT_DIR_PREFIX, SOCKET, OWNER = "zklock-agent-", "agent.sock", "owner"


def socket_path() -> str:
    """A fresh socket path in a private directory (mode 0700), short enough for AF_UNIX."""
    return os.path.join(tempfile.mkdtemp(prefix=AGENT_DIR_PREFIX), SOCKET)


class LineReader:
    """Split a byte stream into messages.  A line that is no message is logged and skipped:
    one bad line must not take a process's link to the agent down."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, data: bytes) -> list:
        self._buffer += data
        *lines, self._buffer = self._buffer.split(b"\n")
        messages = []
        for line in lines:
            if not line:
                continue
            try:
                messages.append(decode(line))
            except ProtocolError as exc:
                logger.error("celery-zklock: a line on the lock agent's socket is no message of its protocol, "
                             "skipped: %s", exc)
        return messages


class Connection:
    """A connection with a thread-safe ``send`` (used by agent and pool processes).

    A pool process's sends block (it waits for the answer anyway).  The agent's never do:
    made with ``on_backlog``, what the peer's socket cannot take now waits in an outbox, and
    ``on_backlog()`` asks the agent's event loop to :meth:`flush` it when the socket is
    writable.  Why: an agent blocked on a peer that is itself blocked sending to it (the
    worker's main process re-sending its backlog after an agent restart) stalled both for
    good, and with them every key they queued for."""

    def __init__(self, sock: socket.socket, on_backlog=None) -> None:
        self.sock = sock
        self._send_guard = threading.Lock()
        self._reader = LineReader()
        self.closed = False
        self._on_backlog = on_backlog
        self._outbox = bytearray()  # bytes the peer's socket did not take yet (with on_backlog)

    @classmethod
    def open(cls, path: str, timeout: float = 5.0) -> "Connection":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        sock.connect(path)
        sock.settimeout(None)
        return cls(sock)

    def send(self, message) -> bool:
        """Send one message; False once the other side is gone."""
        data = encode(message)
        with self._send_guard:
            if self.closed:
                return False
            if self._on_backlog is not None:
                return self._queue(data)
            try:
                self.sock.sendall(data)
                return True
            except OSError:
                self.closed = True
                return False

    def _queue(self, data: bytes) -> bool:
        """Non-blocking send, under the guard: what does not fit waits in the outbox, whose
        order a later send never jumps."""
        backlog = bool(self._outbox)
        self._outbox += data
        if not backlog:
            self._write()
            if self._outbox:
                self._on_backlog()
        return not self.closed

    def _write(self) -> None:
        try:
            sent = self.sock.send(self._outbox, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self.closed = True  # the reader sees the end and lets go of what it held
            self._outbox.clear()
            return
        del self._outbox[:sent]

    def flush(self) -> bool:
        """The socket is writable: send what waits; True once nothing does."""
        with self._send_guard:
            if self._outbox and not self.closed:
                self._write()
            return not self._outbox

    @property
    def pending(self) -> int:
        """Bytes waiting in the outbox."""
        return len(self._outbox)

    def receive(self, block: bool = True) -> list | None:
        """The next messages (blocking for them, or ``[]`` when none are there yet with
        ``block=False``); None at end of stream."""
        try:
            data = self.sock.recv(65536) if block else self.sock.recv(65536, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return []
        except OSError:
            data = b""
        if not data:
            self.closed = True
            return None
        return self._reader.feed(data)

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.close()
        except OSError:
            pass
