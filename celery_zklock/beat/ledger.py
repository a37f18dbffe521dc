"""The tick records in ZooKeeper: one node per schedule entry, written only by the leader.

Why a ``multi`` per write: it checks that our election node still exists and sets the record
at the version we last saw, in one transaction.  Applied, it proves we led at that zxid and
that nobody wrote the entry since; so a deposed leader's write fails, and two leaders can
never both record the same due time.
"""

from __future__ import annotations

from kazoo.client import KazooClient
from kazoo.exceptions import (
    BadVersionError,
    ConnectionLoss,
    NodeExistsError,
    NoNodeError,
    OperationTimeoutError,
    RolledBackError,
    SessionExpiredError,
    ZookeeperError,
)

from ..engine.kazoo_compat import acl_for
from ..keys import encode_key
from .rules import TickRecord, Written


class Ledger:
    """The records of one group's entries (``{group path}/ticks/{entry}``), with the version
    of each as last read or written by this beat."""

    def __init__(self, client: KazooClient, path: str, timeout: float) -> None:
        self.client = client
        self.path = f"{path}/ticks"
        self.timeout = timeout  # bound on each request: a beat never hangs on ZooKeeper
        self._known: dict[str, tuple[TickRecord | None, int | None]] = {}  # node name: (record, version)
        self._written: dict[str, int] = {}  # node name: the server's stamp of its last write (mtime, ms)
        self.beats = f"{path}/beats"  # each beat's presence: its entries, when it began to lead
        self.last_skew: float | None = None  # this beat's clock minus ZooKeeper's, at its last write

    def node(self, name: str) -> str:
        return f"{self.path}/{encode_key(name)}"

    def load(self) -> None:
        """Read every record (a new leader's first step); raises kazoo errors."""
        self.client.ensure_path_async(self.path, acl=acl_for(self.client, self.path)).get(timeout=self.timeout)
        names = self.client.get_children_async(self.path).get(timeout=self.timeout)
        pending = [(n, self.client.get_async(f"{self.path}/{n}")) for n in names]
        self._known, self._written = {}, {}
        for node_name, result in pending:
            try:
                data, stat = result.get(timeout=self.timeout)
            except NoNodeError:
                continue
            self._known[node_name] = (TickRecord.parse(data), stat.version)
            self._written[node_name] = stat.mtime

    def read(self, name: str) -> TickRecord | None:
        """The record of ``name`` as last loaded or written (no I/O)."""
        return self._known.get(encode_key(name), (None, None))[0]

    def refresh(self, name: str) -> TickRecord | None:
        """Read ``name``'s record again (after a conflict or an unanswered write); raises kazoo's
        errors, or the handler's timeout after ``timeout``."""
        try:
            data, stat = self.client.get_async(self.node(name)).get(timeout=self.timeout)
        except NoNodeError:
            self._known.pop(encode_key(name), None)
            return None
        self._known[encode_key(name)] = (TickRecord.parse(data), stat.version)
        self._written[encode_key(name)] = stat.mtime
        return self.read(name)

    def written(self, name: str) -> int | None:
        """When ZooKeeper applied the last write of ``name``'s record (its mtime, ms), if known."""
        return self._written.get(encode_key(name))

    def adjust(self, name: str, record: TickRecord) -> None:
        """Keep ``record`` (a time moved to this beat's clock) as ``name``'s, at the version read."""
        key = encode_key(name)
        if key in self._known:
            self._known[key] = (record, self._known[key][1])

    def announce(self, me: str, data: bytes, now, fresh: bool = False) -> int | None:
        """Write this beat's presence node (ephemeral: ``data`` says its entries and whether it
        leads; ``fresh``: made anew, so that its ctime says when this beat began to lead) and
        measure this beat's clock (``now()``, seconds) against the server's stamp of the write
        (:attr:`last_skew`).  Returns that stamp (ms), or None if it failed."""
        node = f"{self.beats}/{encode_key(me)}"
        try:
            if fresh:
                try:
                    self.client.delete_async(node).get(timeout=self.timeout)
                except NoNodeError:
                    pass
            sent = now()
            try:
                stat = self.client.set_async(node, data).get(timeout=self.timeout)
            except NoNodeError:
                _, stat = self.client.create_async(node, data, acl=acl_for(self.client, node), ephemeral=True,
                                                   makepath=True, include_data=True).get(timeout=self.timeout)
            received = now()
        except Exception:
            return None
        self.last_skew = (sent + received) / 2 - stat.mtime / 1000.0
        return stat.mtime

    def others(self, me: str, watch=None) -> dict[str, bytes]:
        """The presence data of the group's other beats, by name; ``watch`` is called once when
        a beat comes or goes.  Raises kazoo errors."""
        try:
            names = self.client.get_children_async(self.beats, watch=watch).get(timeout=self.timeout)
        except NoNodeError:
            return {}
        pending = [(n, self.client.get_async(f"{self.beats}/{n}")) for n in names if n != encode_key(me)]
        found = {}
        for name, result in pending:
            try:
                found[name] = result.get(timeout=self.timeout)[0]
            except NoNodeError:
                continue
        return found

    def write(self, name: str, record: TickRecord, leader_node: str, now=None) -> Written:
        """Record ``record`` if our election node exists and nobody wrote since our read.  With
        ``now`` (this beat's clock, seconds), also measure it against the server's stamp of the
        write (:attr:`last_skew`)."""
        sent = now() if now is not None else None
        version = self._known.get(encode_key(name), (None, None))[1]
        txn = self.client.transaction()
        txn.check(leader_node, -1)
        if version is None:
            txn.create(self.node(name), record.to_bytes(), acl=acl_for(self.client, self.node(name)))
        else:
            txn.set_data(self.node(name), record.to_bytes(), version=version)
        try:
            results = txn.commit_async().get(timeout=self.timeout)
        except (ConnectionLoss, OperationTimeoutError, self.client.handler.timeout_exception):
            return Written.UNKNOWN
        except SessionExpiredError:
            return Written.DEPOSED
        first, second = results
        if isinstance(first, NoNodeError):
            return Written.DEPOSED
        if isinstance(second, (BadVersionError, NodeExistsError, NoNodeError)):
            return Written.CONFLICT
        if isinstance(first, Exception) or isinstance(second, Exception):
            error = second if not isinstance(second, RolledBackError) else first
            raise error if isinstance(error, ZookeeperError) else RuntimeError(str(error))
        self._known[encode_key(name)] = (record, 0 if version is None else version + 1)
        if hasattr(second, "mtime"):  # a set's reply is the node's stat: the server's clock
            self._written[encode_key(name)] = second.mtime
            if sent is not None:
                self.last_skew = (sent + now()) / 2 - second.mtime / 1000.0
        return Written.RECORDED
