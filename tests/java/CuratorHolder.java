// Test helper for tests/test_lock_interop.py: an Apache Curator InterProcessMutex driven
// line by line over stdin, so one JVM serves a whole test (JVM start-up is the slow part).
//
// Usage:  java -cp <curator jars>:<dir> CuratorHolder <connectString> <lockPath> [sessionTimeoutMs]
//
// Prints "READY <nanoTime>" once connected, then runs one command per stdin line:
//   acquire      block until the mutex is held, then print "ACQUIRED <nanoTime>"
//   try <ms>     acquire with a timeout: "ACQUIRED <nanoTime>" or "TIMEOUT"
//   hold <ms>    acquire, print "ACQUIRED <nanoTime>", hold <ms> milliseconds, release,
//                print "RELEASED <nanoTime>"
//   release      release the mutex, print "RELEASED <nanoTime>"
//   quit / EOF   release if held, close the client, print "BYE" and exit
// Before blocking in acquire it prints "ACQUIRING <nanoTime>".  Errors print "ERROR <text>".
//
// <nanoTime> is System.nanoTime(): on Linux both it and Python's time.monotonic() read
// CLOCK_MONOTONIC, so the test can compare hold intervals across the two processes.

import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.nio.charset.StandardCharsets;
import java.util.concurrent.TimeUnit;

import org.apache.curator.framework.CuratorFramework;
import org.apache.curator.framework.CuratorFrameworkFactory;
import org.apache.curator.framework.recipes.locks.InterProcessMutex;
import org.apache.curator.retry.RetryNTimes;

public final class CuratorHolder {
    private static void say(String line) {
        System.out.println(line);
        System.out.flush();
    }

    public static void main(String[] args) throws Exception {
        if (args.length < 2) {
            System.err.println("usage: CuratorHolder <connectString> <lockPath> [sessionTimeoutMs]");
            System.exit(2);
        }
        String connect = args[0];
        String path = args[1];
        int sessionMs = args.length > 2 ? Integer.parseInt(args[2]) : 4000;

        CuratorFramework client = CuratorFrameworkFactory.newClient(
                connect, sessionMs, 10000, new RetryNTimes(100, 100));
        client.start();
        if (!client.blockUntilConnected(30, TimeUnit.SECONDS)) {
            say("ERROR not connected to " + connect);
            System.exit(1);
        }
        InterProcessMutex mutex = new InterProcessMutex(client, path);
        say("READY " + System.nanoTime());

        BufferedReader in = new BufferedReader(new InputStreamReader(System.in, StandardCharsets.UTF_8));
        String line;
        while ((line = in.readLine()) != null) {
            String[] cmd = line.trim().split("\\s+");
            try {
                switch (cmd[0]) {
                    case "acquire":
                        say("ACQUIRING " + System.nanoTime());
                        mutex.acquire();
                        say("ACQUIRED " + System.nanoTime());
                        break;
                    case "try":
                        say("ACQUIRING " + System.nanoTime());
                        if (mutex.acquire(Long.parseLong(cmd[1]), TimeUnit.MILLISECONDS)) {
                            say("ACQUIRED " + System.nanoTime());
                        } else {
                            say("TIMEOUT");
                        }
                        break;
                    case "hold":
                        say("ACQUIRING " + System.nanoTime());
                        mutex.acquire();
                        say("ACQUIRED " + System.nanoTime());
                        Thread.sleep(Long.parseLong(cmd[1]));
                        long released = System.nanoTime();
                        mutex.release();
                        say("RELEASED " + released);
                        break;
                    case "release": {
                        // Stamp before the delete: from here on we no longer treat it as held.
                        long t = System.nanoTime();
                        mutex.release();
                        say("RELEASED " + t);
                        break;
                    }
                    case "quit":
                        finish(client, mutex);
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
        finish(client, mutex);
    }

    private static void finish(CuratorFramework client, InterProcessMutex mutex) {
        try {
            while (mutex.isAcquiredInThisProcess()) {
                mutex.release();
            }
        } catch (Exception ignored) {
            // the session is closed below anyway; its ephemeral node goes with it
        }
        client.close();
        say("BYE");
    }
}
