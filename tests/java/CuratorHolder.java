// Test helper for tests/engine/test_lock_interop.py and test_rwlock_interop_curator.py: an
// Apache Curator InterProcessMutex, or the two sides of an InterProcessReadWriteLock, driven
// line by line over stdin, so one JVM serves a whole test (JVM start-up is the slow part).
//
// Usage:  java -cp <curator jars>:<dir> CuratorHolder <connectString> <lockPath> [sessionTimeoutMs] [mutex|rw]
//
// Prints "READY <nanoTime>" once connected, then runs one command per stdin line; <side> is
// "read" or "write" for an rw holder, and absent for a mutex holder:
//   acquire <side>      block until held, then print "ACQUIRED <nanoTime>"
//   try <ms> <side>     acquire with a timeout: "ACQUIRED <nanoTime>" or "TIMEOUT"
//   hold <ms> <side>    acquire, print "ACQUIRED <nanoTime>", hold <ms> milliseconds, release,
//                       print "RELEASED <nanoTime>"
//   release <side>      release (one hold), print "RELEASED <nanoTime>"
//   quit / EOF          release every hold, close the client, print "BYE" and exit
// Before blocking in an acquire it prints "ACQUIRING <nanoTime>".  Errors print "ERROR <text>".
// Every command runs on the main thread: Curator's holds are the thread's, so its re-entry
// rules (a write holder may read, a downgrade) apply across commands.
//
// <nanoTime> is System.nanoTime(): on Linux both it and Python's time.monotonic() read
// CLOCK_MONOTONIC, so the test can compare hold intervals across the two processes.  An
// ACQUIRED stamp is taken after the acquire returns, a RELEASED stamp before the release
// starts: the interval printed lies inside the hold.

import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.nio.charset.StandardCharsets;
import java.util.LinkedHashMap;
import java.util.Map;
import java.util.concurrent.TimeUnit;

import org.apache.curator.framework.CuratorFramework;
import org.apache.curator.framework.CuratorFrameworkFactory;
import org.apache.curator.framework.recipes.locks.InterProcessMutex;
import org.apache.curator.framework.recipes.locks.InterProcessReadWriteLock;
import org.apache.curator.retry.RetryNTimes;

public final class CuratorHolder {
    private static final String MUTEX = "mutex";

    private static void say(String line) {
        System.out.println(line);
        System.out.flush();
    }

    public static void main(String[] args) throws Exception {
        if (args.length < 2) {
            System.err.println("usage: CuratorHolder <connectString> <lockPath> [sessionTimeoutMs] [mutex|rw]");
            System.exit(2);
        }
        String connect = args[0];
        String path = args[1];
        int sessionMs = args.length > 2 ? Integer.parseInt(args[2]) : 4000;
        String kind = args.length > 3 ? args[3] : MUTEX;

        CuratorFramework client = CuratorFrameworkFactory.newClient(
                connect, sessionMs, 10000, new RetryNTimes(100, 100));
        client.start();
        if (!client.blockUntilConnected(30, TimeUnit.SECONDS)) {
            say("ERROR not connected to " + connect);
            System.exit(1);
        }
        // Both sides of a read/write lock are InterProcessMutex subclasses.
        Map<String, InterProcessMutex> locks = new LinkedHashMap<>();
        if (kind.equals(MUTEX)) {
            locks.put(MUTEX, new InterProcessMutex(client, path));
        } else if (kind.equals("rw")) {
            InterProcessReadWriteLock rw = new InterProcessReadWriteLock(client, path);
            locks.put("read", rw.readLock());
            locks.put("write", rw.writeLock());
        } else {
            say("ERROR unknown lock kind " + kind + " (mutex or rw)");
            System.exit(2);
        }
        say("READY " + System.nanoTime());

        BufferedReader in = new BufferedReader(new InputStreamReader(System.in, StandardCharsets.UTF_8));
        String line;
        while ((line = in.readLine()) != null) {
            String[] cmd = line.trim().split("\\s+");
            try {
                switch (cmd[0]) {
                    case "acquire": {
                        InterProcessMutex lock = side(locks, cmd, 1);
                        say("ACQUIRING " + System.nanoTime());
                        lock.acquire();
                        say("ACQUIRED " + System.nanoTime());
                        break;
                    }
                    case "try": {
                        InterProcessMutex lock = side(locks, cmd, 2);
                        say("ACQUIRING " + System.nanoTime());
                        if (lock.acquire(Long.parseLong(cmd[1]), TimeUnit.MILLISECONDS)) {
                            say("ACQUIRED " + System.nanoTime());
                        } else {
                            say("TIMEOUT");
                        }
                        break;
                    }
                    case "hold": {
                        InterProcessMutex lock = side(locks, cmd, 2);
                        say("ACQUIRING " + System.nanoTime());
                        lock.acquire();
                        say("ACQUIRED " + System.nanoTime());
                        Thread.sleep(Long.parseLong(cmd[1]));
                        long released = System.nanoTime();
                        lock.release();
                        say("RELEASED " + released);
                        break;
                    }
                    case "release": {
                        InterProcessMutex lock = side(locks, cmd, 1);
                        // Stamp before the delete: from here on we no longer treat it as held.
                        long t = System.nanoTime();
                        lock.release();
                        say("RELEASED " + t);
                        break;
                    }
                    case "quit":
                        finish(client, locks);
                        return;
                    case "":
                        break;
                    default:
                        say("ERROR unknown command " + cmd[0]);
                }
            } catch (Exception e) {
                say("ERROR " + e);
            }
        }
        finish(client, locks);
    }

    /** The lock a command names at cmd[index]: the only one of a mutex holder when absent. */
    private static InterProcessMutex side(Map<String, InterProcessMutex> locks, String[] cmd, int index) {
        String name = cmd.length > index ? cmd[index] : MUTEX;
        InterProcessMutex lock = locks.get(name);
        if (lock == null) {
            throw new IllegalArgumentException("no lock side " + name + " here (sides: " + locks.keySet() + ")");
        }
        return lock;
    }

    private static void finish(CuratorFramework client, Map<String, InterProcessMutex> locks) {
        for (InterProcessMutex lock : locks.values()) {
            try {
                while (lock.isAcquiredInThisProcess()) {
                    lock.release();
                }
            } catch (Exception ignored) {
                // the session is closed below anyway; its ephemeral nodes go with it
            }
        }
        client.close();
        say("BYE");
    }
}
