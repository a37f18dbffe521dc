"""Apache Curator in a real JVM, for the interop tests: ``tests/java/CuratorHolder.java``
compiled per test session (:func:`compile_holder`, the ``curator_classpath`` fixture), and
:class:`Curator`, one JVM driven over stdin (the ``curators`` fixture starts them)."""

from __future__ import annotations

import os
import queue
import shutil
import subprocess
import threading
import time

import pytest

JAVA_SRC = os.path.join(os.path.dirname(__file__), "java", "CuratorHolder.java")
JAR_DIR = os.environ.get("CURATOR_JAR_DIR", "/usr/share/java")
# The Debian jars carry Class-Path manifests that pull in guava, zookeeper and slf4j-api.
CURATOR_JARS = ("curator-recipes", "curator-framework", "curator-client")


def compile_holder(out_dir: str) -> str:
    """Compile CuratorHolder into ``out_dir``; the classpath that runs it.  Skips the test
    when no JDK or no Curator jars are installed (scripts/bootstrap.sh installs both)."""
    javac = shutil.which("javac")
    if javac is None:
        pytest.skip("javac not found: install a JDK (scripts/bootstrap.sh installs default-jdk-headless)")
    jars = [os.path.join(JAR_DIR, f"{name}.jar") for name in CURATOR_JARS]
    missing = [j for j in jars if not os.path.exists(j)]
    if missing:
        pytest.skip(
            f"Curator jars not found ({', '.join(missing)}): "
            "apt-get install libcurator-recipes-java (scripts/bootstrap.sh does)"
        )
    cp = os.pathsep.join(jars)
    res = subprocess.run([javac, "-d", out_dir, "-cp", cp, JAVA_SRC], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, f"javac failed:\n{res.stdout}\n{res.stderr}"
    extra = [os.path.join(JAR_DIR, "slf4j-nop.jar")]  # silence slf4j's no-binding warning
    return os.pathsep.join([out_dir] + jars + [j for j in extra if os.path.exists(j)])


class Curator:
    """One JVM running CuratorHolder on ``path``: an ``InterProcessMutex`` (``lock="mutex"``)
    or an ``InterProcessReadWriteLock`` (``lock="rw"``: commands name a side, ``acquire
    read``, ``hold 5 write``).  Commands over stdin, replies read from stdout.

    Stamps in replies are System.nanoTime(); on Linux that is CLOCK_MONOTONIC, the clock of
    Python's time.monotonic(), which the constructor verifies.
    """

    def __init__(self, classpath: str, hosts: str, path: str, lock: str = "mutex") -> None:
        self.lines: "queue.Queue[str | None]" = queue.Queue()
        self.stderr: list[str] = []
        before = time.monotonic()
        self.proc = subprocess.Popen(
            ["java", "-Xshare:auto", "-XX:TieredStopAtLevel=1", "-Xmx128m", "-cp", classpath, "CuratorHolder",
             hosts, path, "4000", lock],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1,
        )
        threading.Thread(target=self._pump, args=(self.proc.stdout, self.lines.put), daemon=True).start()
        threading.Thread(target=self._pump, args=(self.proc.stderr, self.stderr.append), daemon=True).start()
        ready = self.expect("READY", timeout=60)
        after = time.monotonic()
        assert before <= ready <= after, (
            f"CuratorHolder's System.nanoTime() ({ready}) is not time.monotonic() ({before}..{after})"
        )

    @staticmethod
    def _pump(stream, put):
        for line in stream:
            put(line.rstrip("\n"))

    def send(self, command: str) -> None:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def next_line(self, timeout: float):
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            return None

    def expect(self, word: str, timeout: float = 15.0) -> float:
        """The next line must start with ``word``; returns its stamp in monotonic seconds."""
        line = self.next_line(timeout)
        if line is None or not line.startswith(word):
            raise AssertionError(
                f"expected {word!r} from CuratorHolder, got {line!r}; stderr:\n" + "\n".join(self.stderr[-30:])
            )
        parts = line.split()
        return int(parts[1]) / 1e9 if len(parts) > 1 and parts[1].isdigit() else float("nan")

    def acquire(self, side: str = "") -> float:
        """Acquire (``side`` of an rw holder), blocking this test too; the ACQUIRED stamp."""
        self.send(f"acquire {side}".strip())
        self.expect("ACQUIRING")
        return self.expect("ACQUIRED")

    def release(self, side: str = "") -> float:
        """Release one hold; the RELEASED stamp (taken before the delete)."""
        self.send(f"release {side}".strip())
        return self.expect("RELEASED")

    def hold_each(self, sides, ms: int) -> None:
        """Queue a ``hold <ms> <side>`` per side (an rw holder): the JVM runs them in turn."""
        for side in sides:
            self.send(f"hold {ms} {side}")

    def holds(self, sides, label: str = "curator", timeout: float = 60.0) -> list[tuple]:
        """The spans of the holds :meth:`hold_each` queued: ``(side, start, end, label)``."""
        spans = []
        for side in sides:
            self.expect("ACQUIRING", timeout=timeout)
            spans.append((side, self.expect("ACQUIRED", timeout=timeout), self.expect("RELEASED", timeout=timeout),
                          label))
        return spans

    def assert_silent(self, seconds: float) -> None:
        line = self.next_line(seconds)
        assert line is None, f"CuratorHolder said {line!r} while it should have been blocked"

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.send("quit")
                self.proc.wait(10)
        except Exception:
            pass
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
