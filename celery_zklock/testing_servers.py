"""Real ZooKeeper servers for tests: a standalone server and a 3-node ensemble.

Why this exists: a lock library cannot be tested against a fake coordinator — the
behaviours that matter (session expiry, leader loss, ghost nodes, watch delivery) only
happen in the real server.  This module starts ZooKeeper from the local installation
(Debian's ``zookeeper`` package jars, or ``$ZOOKEEPER_HOME``) on free loopback ports in a
temporary directory, and lets tests stop, restart and pause (SIGSTOP) members.

Test servers run with a short ``tickTime`` (200 ms by default) so the negotiated session
timeout may be as low as 0.4 s: fault tests expire sessions in about a second.
Standard library only; the pytest fixtures on top are :mod:`celery_zklock.testing`.
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field

from .testing_probes import four_letter_word, free_port
from .testing_tls import TlsMaterial

# Jars a ZooKeeper 3.5+ server needs at run time, by file-name prefix.  Debian splits
# them across /usr/share/java; a binary tarball has them all under $ZOOKEEPER_HOME/lib.
_SERVER_JARS = (
    "zookeeper",
    "zookeeper-jute",
    "netty-buffer",
    "netty-codec",
    "netty-common",
    "netty-handler",
    "netty-resolver",
    "netty-transport",
    "netty-transport-native-epoll",
    "netty-transport-native-unix-common",
    "slf4j-api",
    "slf4j-simple",
    "metrics-core",
    "commons-cli",
    "snappy-java",
    "log4j-1.2",
)

_INSTALL_HINT = (
    "No ZooKeeper installation found. Install one with "
    "'apt-get install -y zookeeper' (Debian/Ubuntu), or download Apache ZooKeeper and "
    "set ZOOKEEPER_HOME to its directory. A Java runtime ('java' on PATH) is needed too."
)


class ZooKeeperNotInstalled(RuntimeError):
    """Raised when neither ``$ZOOKEEPER_HOME`` nor Debian's jars can be found."""


def zookeeper_classpath() -> str:
    """Return a Java classpath that can run ``ZooKeeperServerMain``.

    ``$ZOOKEEPER_HOME`` wins when set (all jars under it and its ``lib/``); otherwise the
    Debian layout in ``/usr/share/java`` is used, picking the unversioned symlinks.
    """
    if shutil.which("java") is None:
        raise ZooKeeperNotInstalled(_INSTALL_HINT + " ('java' is not on PATH.)")
    home = os.environ.get("ZOOKEEPER_HOME")
    if home:
        jars = sorted(glob.glob(os.path.join(home, "*.jar")) + glob.glob(os.path.join(home, "lib", "*.jar")))
        if not any(os.path.basename(j).startswith("zookeeper") for j in jars):
            raise ZooKeeperNotInstalled(f"ZOOKEEPER_HOME={home!r} holds no zookeeper jar. " + _INSTALL_HINT)
        return os.pathsep.join(jars)
    base = "/usr/share/java"
    jars = [os.path.join(base, f"{name}.jar") for name in _SERVER_JARS]
    if not os.path.exists(jars[0]):
        raise ZooKeeperNotInstalled(_INSTALL_HINT)
    return os.pathsep.join(j for j in jars if os.path.exists(j))


@dataclass
class ZooKeeperServer:
    """One ZooKeeper server process (standalone, or a member of an ensemble).

    ``peers`` is filled in by :class:`ZooKeeperEnsemble`; a server without peers runs
    ``ZooKeeperServerMain``.  All ports bind to 127.0.0.1.

    With ``tls`` the server listens only on a TLS port (``secureClientPort``, Netty) and
    requires a client certificate signed by ``tls.ca`` (``ssl.clientAuth=need``).  With
    ``sasl_users`` ({user: password}) every session must authenticate with SASL
    DIGEST-MD5 (a JAAS file written at start) before it may do anything.
    """

    tick_ms: int = 200
    client_port: int = field(default_factory=free_port)
    workdir: str | None = None
    myid: int = 1
    peers: dict[int, tuple[int, int, int]] = field(default_factory=dict)  # id -> (client, quorum, election)
    fsync: bool = True
    container_check_ms: int = 100
    max_client_cnxns: int = 0
    tls: TlsMaterial | None = field(default=None, repr=False)
    sasl_users: dict[str, str] | None = field(default=None, repr=False)
    extra_config: dict[str, str] = field(default_factory=dict)  # more zoo.cfg lines (minSessionTimeout...)
    proc: subprocess.Popen | None = field(default=None, repr=False)
    _own_workdir: bool = field(default=False, repr=False)

    @property
    def hosts(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def _write_config(self) -> str:
        assert self.workdir
        data = os.path.join(self.workdir, "data")
        os.makedirs(data, exist_ok=True)
        if self.tls is not None:
            port_lines = [
                f"secureClientPort={self.client_port}",
                "secureClientPortAddress=127.0.0.1",
                "serverCnxnFactory=org.apache.zookeeper.server.NettyServerCnxnFactory",
                f"ssl.keyStore.location={self.tls.server}",
                "ssl.keyStore.type=PEM",
                f"ssl.trustStore.location={self.tls.ca}",
                "ssl.trustStore.type=PEM",
                "ssl.clientAuth=need",
            ]
        else:
            port_lines = [f"clientPort={self.client_port}", "clientPortAddress=127.0.0.1"]
        if self.sasl_users:
            port_lines += [
                "authProvider.1=org.apache.zookeeper.server.auth.SASLAuthenticationProvider",
                "sessionRequireClientSASLAuth=true",
                "enforce.auth.enabled=true",
                "enforce.auth.schemes=sasl",
            ]
        lines = [
            f"tickTime={self.tick_ms}",
            f"dataDir={data}",
            *port_lines,
            f"maxClientCnxns={self.max_client_cnxns}",
            "initLimit=20",
            "syncLimit=10",
            "4lw.commands.whitelist=*",
            "admin.enableServer=false",
            f"forceSync={'yes' if self.fsync else 'no'}",
            "autopurge.purgeInterval=0",
            *(f"{k}={v}" for k, v in self.extra_config.items()),
        ]
        if self.peers:
            with open(os.path.join(data, "myid"), "w") as f:
                f.write(str(self.myid))
            for sid, (_, quorum, election) in sorted(self.peers.items()):
                lines.append(f"server.{sid}=127.0.0.1:{quorum}:{election}")
        path = os.path.join(self.workdir, "zoo.cfg")
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
        return path

    def start(self, wait: bool = True, timeout: float = 30.0, new_session: bool = False) -> "ZooKeeperServer":
        """Start the server; ``new_session=True`` keeps a terminal's Ctrl-C from reaching it,
        so a demo or test runner can stop its workers before the services they use."""
        if self.proc is not None and self.proc.poll() is None:
            return self
        if self.workdir is None:
            self.workdir = tempfile.mkdtemp(prefix="zklock-zk-")
            self._own_workdir = True
        cfg = self._write_config()
        main = (
            "org.apache.zookeeper.server.quorum.QuorumPeerMain"
            if self.peers
            else "org.apache.zookeeper.server.ZooKeeperServerMain"
        )
        cmd = [
            "java",
            "-Xmx256m",
            "-XX:+UseSerialGC",
            "-Xshare:auto",
            "-XX:TieredStopAtLevel=1",
            "-cp",
            zookeeper_classpath(),
            f"-Dznode.container.checkIntervalMs={self.container_check_ms}",
            "-Dznode.container.maxPerMinute=1000000",
            "-Dzookeeper.admin.enableServer=false",
            "-Dorg.slf4j.simpleLogger.defaultLogLevel=warn",
            *self._jaas_options(),
            main,
            cfg,
        ]
        log = open(os.path.join(self.workdir, "server.log"), "ab")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=new_session)
        log.close()
        if wait:
            self.wait_serving(timeout)
        return self

    def _jaas_options(self) -> list[str]:
        if not self.sasl_users:
            return []
        users = "\n".join(f'  user_{u}="{p}"' for u, p in self.sasl_users.items())
        path = os.path.join(self.workdir or "", "jaas.conf")
        with open(path, "w") as f:
            f.write("Server {\n  org.apache.zookeeper.server.auth.DigestLoginModule required\n" + users + ";\n};\n")
        return [f"-Djava.security.auth.login.config={path}", "-Dzookeeper.authProvider.1="
                "org.apache.zookeeper.server.auth.SASLAuthenticationProvider"]

    def wait_serving(self, timeout: float = 30.0) -> None:
        """Block until the server answers ``ruok`` and (in an ensemble) has a role."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"ZooKeeper exited with {self.proc.returncode}; log:\n{self.log_tail()}")
            if self.mode() in ("standalone", "leader", "follower"):
                return
            time.sleep(0.05)
        raise TimeoutError(f"ZooKeeper on {self.hosts} not serving after {timeout}s; log:\n{self.log_tail()}")

    def mode(self) -> str | None:
        """``standalone``, ``leader``, ``follower`` or None when not serving."""
        try:
            out = four_letter_word("127.0.0.1", self.client_port, "srvr", timeout=0.5, tls=self.tls)
        except OSError:
            return None
        for line in out.splitlines():
            if line.startswith("Mode:"):
                return line.split(":", 1)[1].strip()
        return None

    def log_tail(self, n: int = 40) -> str:
        try:
            with open(os.path.join(self.workdir or "", "server.log"), errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return "(no log)"

    def stop(self, kill: bool = False) -> None:
        """Stop the server (SIGTERM, or SIGKILL with ``kill=True``); data survives for restart."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.resume()
            self.proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def kill(self) -> None:
        self.stop(kill=True)

    def restart(self, wait: bool = True) -> None:
        self.stop()
        self.start(wait=wait)

    def pause(self) -> None:
        """SIGSTOP: the process is alive but answers nothing (a hung or partitioned server)."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)

    def close(self) -> None:
        """Stop and remove the temporary directory this object created."""
        self.stop(kill=True)
        if self._own_workdir and self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "ZooKeeperServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def _status(member: "ZooKeeperServer") -> str:
    if member.proc is None:
        return "stopped"
    if member.proc.poll() is not None:
        return f"exited with {member.proc.returncode}"
    return str(member.mode())


class ZooKeeperEnsemble:
    """A quorum of ``size`` ZooKeeper servers on loopback, for failover tests."""

    def __init__(self, size: int = 3, tick_ms: int = 200, fsync: bool = True) -> None:
        self.workdir = tempfile.mkdtemp(prefix="zklock-ensemble-")
        ports = {sid: (free_port(), free_port(), free_port()) for sid in range(1, size + 1)}
        self.members = [
            ZooKeeperServer(
                tick_ms=tick_ms,
                client_port=ports[sid][0],
                workdir=os.path.join(self.workdir, f"zk{sid}"),
                myid=sid,
                peers=ports,
                fsync=fsync,
            )
            for sid in sorted(ports)
        ]

    @property
    def hosts(self) -> str:
        return ",".join(m.hosts for m in self.members)

    def start(self, timeout: float = 60.0) -> "ZooKeeperEnsemble":
        for m in self.members:
            m.start(wait=False)
        for m in self.members:
            m.wait_serving(timeout)
        return self

    def leader(self) -> ZooKeeperServer:
        for _ in range(200):
            for m in self.members:
                if m.proc is not None and m.mode() == "leader":
                    return m
            time.sleep(0.05)
        raise RuntimeError("ensemble has no leader")

    def followers(self) -> list[ZooKeeperServer]:
        lead = self.leader()
        return [m for m in self.members if m is not lead]

    def wait_quorum(self, timeout: float = 30.0, followers: int | None = None) -> None:
        """Wait for a leader and ``followers`` followers (default: enough for a quorum)."""
        needed = len(self.members) // 2 if followers is None else followers
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            modes = [m.mode() for m in self.members if m.proc is not None]
            if "leader" in modes and modes.count("follower") >= needed:
                return
            time.sleep(0.05)
        report = "\n".join(
            f"server {m.myid} ({m.hosts}): {_status(m)}\n{m.log_tail(15)}"
            for m in self.members
        )
        raise TimeoutError(f"ensemble did not regain a quorum in {timeout}s:\n{report}")

    def close(self) -> None:
        for m in self.members:
            m.stop(kill=True)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "ZooKeeperEnsemble":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
