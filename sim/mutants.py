"""Planted bugs: proof that the simulator can fail (``make sim-mutants``).

Each mutant is one textual change to one module of ``celery_zklock``.  The runner copies the
package to a temporary directory, applies the change there (never to the checkout), runs
the simulator's CI seeds against the copy, and reports whether a violation was found, at
which seed and after how many seconds.  Exit status 1 if any mutant survives the CI seeds,
or if a mutant no longer applies (the code it targets changed: update it here).

A rule the simulator does not model (the enqueue guards: their own protocol, beside the
lock's) names its ``killer`` instead: the real-ZooKeeper tests that must fail on the copy.

    python -m sim.mutants                 # every mutant, two at a time
    python -m sim.mutants own-watch       # one, by name
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from .run import CI_SEEDS

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutant:
    name: str
    why: str  # the bug it plants, and the list item it answers
    path: str  # relative to celery_zklock/
    old: str
    new: str
    killer: str = ""  # pytest ids that must fail on it, where the simulator does not reach ("-mslow" for slow ones)


MUTANTS = [
    Mutant("rawlink", "1. kazoo 2.11's rawlink in place of on_ready: a result linked after it is set "
           "runs every earlier callback again",
           "engine/kazoo_compat.py",
           "    result.rawlink(once)\n",
           "    result.rawlink(callback)\n"),
    Mutant("own-watch", "2. the holder's watch on its own node is not set again after a write fires it "
           "(finding 1: a force-delete after a local handoff goes unseen).  Since the lease's renewals are "
           "checks (issue 39) only someone else's write fires it, which the simulator does not model",
           "engine/attempt.py",
           "            elif event.type == EventType.CHANGED and at.state is State.HELD:\n"
           "                self._watch_own_node()",
           "            elif event.type == EventType.CHANGED and at.state is State.HELD:\n"
           "                pass",
           killer="tests/worker/test_cohort_own_node.py::"
                  "test_a_node_deleted_after_a_local_handoff_is_lost_to_its_new_holder"),
    Mutant("suspend-clock", "3. the lease read from a clock that stops in a host's suspend (finding 2)",
           "worker/lease_clock.py",
           "lease_clock: Clock = boottime\n",
           "from ..engine.clock import monotonic\nlease_clock: Clock = monotonic\n"),
    Mutant("read-error", "4. a failed read of the key's queue leaves the streak unbounded (finding 3)",
           "worker/cohort.py",
           "            slot.foreign = True\n            return\n",
           "            return\n"),
    Mutant("late-claim", "5. a claim answered after the pool process gave up on it keeps its grant "
           "(finding 4: the agent ignores unclaim)",
           "worker/agent.py",
           "            case Unclaim():\n                self.claims.unclaim(peer, msg.id)\n",
           "            case Unclaim():\n                pass\n"),
    Mutant("delete-first", "6. a streak ends by deleting the old node before queueing the new one",
           "worker/cohort.py",
           "        if replace and self._next_waiter() is not None:\n            self.pump()\n"
           "        slot.attempt.cancel()\n        _, outcome = slot.attempt.release()\n",
           "        slot.attempt.cancel()\n        _, outcome = slot.attempt.release()\n"
           "        if replace and self._next_waiter() is not None:\n            self.pump()\n"),
    Mutant("grant-before-proof", "7. a local handoff granted before the leaving holder's write proves the node",
           "worker/cohort.py",
           "            slot.holder, slot.handing_on = nxt, True\n"
           "            self._on_passed(proof, slot, nxt, now)\n",
           "            self._grant(slot, nxt, reserved=True)\n"),
    Mutant("revoke-stays-queued", "8. a revoked request is forgotten but left in its key's local queue",
           "worker/agent_requests.py",
           "        if not in_pool:\n            if wait.claimer is None:\n                self.abandon(wait)\n",
           "        if not in_pool:\n            if wait.claimer is None:\n                self.forget(wait)\n"),
    Mutant("ghost-twice", "9. a ghost create adopted twice: the create in flight at a reconnection is sent "
           "again, and both replies are taken",
           "engine/attempt.py",
           "        if self.create_in_flight:\n            return  # its reply",
           "        if False:\n            return  # its reply"),
    Mutant("batch-not-resent", "10. a group-commit batch whose rolled-back creates are not sent again",
           "engine/attempt.py",
           "            if answer.step in (Multi.ROLLED_BACK, Multi.KEY_EXISTS):\n"
           "                if not self.finished and self.state is State.CREATING:\n",
           "            if answer.step in (Multi.ROLLED_BACK, Multi.KEY_EXISTS):\n"
           "                if answer.step is not Multi.ROLLED_BACK and not self.finished and self.state is State.CREATING:\n"),
    Mutant("same-token", "11. a local handoff that does not count its grant: two holders share a token",
           "worker/cohort.py",
           "        slot.grants += 1\n",
           ""),
    Mutant("lease-too-long", "12. a lease that outlives the session (FRESH_MAX past the session timeout)",
           "worker/cohort_rules.py",
           "    return 0.0 <= now - confirmed < lease_window(session_timeout)\n",
           "    return 0.0 <= now - confirmed < 60.0\n"),
    Mutant("no-streak-bound", "13. local handoffs that ignore a foreign contender (no fairness bound)",
           "worker/cohort_rules.py",
           "    if not foreign:\n        return True\n",
           "    if True:\n        return True\n"),
    Mutant("orphan-agent", "14. an agent that exits only once ZooKeeper answers: cut off when its worker "
           "goes, it stays behind",
           "worker/agent.py",
           "        if self.main_seen and self.main is None and not self.claims.any_claimed() and not self.kept:\n"
           "            self.stopped.set()",
           "        if self.main_seen and self.main is None and not self.claims.any_claimed() and not self.kept \\\n"
           "                and self.client.connected:\n"
           "            self.stopped.set()"),
    # The bugs the simulator itself found (docs/simulation.md, "What it found"):
    Mutant("lost-node-kept", "15. a handoff whose write succeeds after its node was marked lost keeps the node "
           "first in the queue with nobody to grant",
           "worker/cohort.py",
           "        if slot in self.slots and (not written or not slot.held or bounded):\n",
           "        if slot in self.slots and (not written or bounded):\n"),
    Mutant("stale-reply-grant", "16. a handoff granted on a write reply that waited past a third of the session "
           "(the agent stopped meanwhile)",
           "worker/cohort.py",
           "            if now - sent >= session_margin(kazoo_compat.session_timeout(self.host.client)):\n",
           "            if False:\n"),
    Mutant("exists-own-watch", "17. the holder's own-node watch set with exists: a creation watch left on the "
           "server for a deleted node, and the deletion not seen",
           "engine/attempt.py",
           "        kazoo_compat.on_ready(self._client.get_async(f\"{self._path}/{node}\", watch=self._own_watcher[2]),",
           "        kazoo_compat.on_ready(self._client.exists_async(f\"{self._path}/{node}\", watch=self._own_watcher[2]),"),
    Mutant("blocking-holders", "18. a timeout's verdict waits for a blocking read of the key's holders",
           "worker/agent_requests.py",
           "        holders_async(self.client, path, wait.max_holders, lambda holders: self.post(told, holders))\n",
           "        from ..engine.contenders import contenders\n"
           "        self.post(told, [c.identifier for c in contenders(self.client, path, wait.max_holders) if c.holder])\n"),
    Mutant("watch-never-run", "19. the agent never says a task runs under a hold: its node is never watched "
           "(issue 39's watch from the claim, left out)",
           "worker/agent_requests.py",
           "            hold.slot.attempt.hold.running()  # its node is watched from now on\n",
           "            pass\n"),
    Mutant("carry-stale", "20. a pool process starts on the grant its task carried however old it is "
           "(issue 39's carried grant without its lease window)",
           "worker/agent_client.py",
           "    if not fresh(proof, lease_clock(), session):\n        return False\n"
           "    if not send(Claim(request_id, carried=True)):\n        return False\n"
           "    return fresh(proof, lease_clock(), session)\n",
           "    return send(Claim(request_id, carried=True))\n"),
    Mutant("carry-abandoned", "21. the agent lets go of a carried grant nobody has claimed yet as soon as the "
           "main process is gone, or Celery drops its request (its pool process may be starting on it)",
           "worker/agent.py",
           "        left = self.requests.carry_left(wait)\n",
           "        left = 0.0\n"),
    Mutant("create-proof-late", "22. a fresh node's first proof dated when it is taken, not when its create was "
           "sent (issue 39's carried first grant): a node that queued past its session still carries",
           "engine/attempt.py",
           "        if self.client.connected:\n            self.state = State.HELD\n",
           "        if self.client.connected:\n            self.create_sent = clock.boottime()\n"
           "            self.state = State.HELD\n"),
    Mutant("misplaced-confirm", "23. a confirm that landed on another publisher's guard (it arrived after its "
           "task started) trusted as it reads: publishes deduped into a run already under way",
           "engine/guard_rules.py",
           "    return found is not None and found.confirmed and bool(found.node)",
           "    return False and found is not None and found.confirmed and bool(found.node)",
           killer="tests/engine/test_guards_confirm.py tests/engine/test_guards_interleavings.py"),
    Mutant("running-guard-v0", "24. a running guard made at version 0, where a confirm on its way can land",
           "engine/guards.py",
           "    txn.set_data(path, data, version=0)\n",
           "",
           killer="tests/engine/test_guards_confirm.py"),
    Mutant("link-dozes", "25. a lock registered while its pool process's link thread dozes does not wake it: "
           "a lost lock's state push waits out the idle sleep, is_held() stays True meanwhile",
           "worker/agent_client.py",
           "                self._dozing = False\n                self._turn.notify_all()\n",
           "                pass\n",
           killer="tests/worker/test_grant_delivery.py::test_a_lock_registered_after_an_idle_spell_is_read_within_the_poll"),
    Mutant("dropped-keeps-grant", "26. a request Celery drops as expired after its grant (it waited for a pool "
           "process) does not let go of it: nobody claims the grant, the key stays held until the worker stops",
           "worker/worker_hooks.py",
           "        finally:\n            wait_outside_pool.request_finished(self)\n\n    def on_timeout",
           "        finally:\n            pass\n\n    def on_timeout",
           killer="tests/worker/test_expired_grant.py::"
                  "test_a_granted_request_that_expires_before_a_process_frees_lets_go_of_its_key"),
    Mutant("expired-waits-on", "27. a request whose expires passes while it waits for its lock keeps waiting: "
           "granted after the holder, then dropped",
           "worker/wait_outside_pool.py",
           "            elif req.maybe_expire():  # past it: revoked, as Celery marks an expired request\n",
           "            elif False:\n",
           killer="tests/worker/test_expired_grant.py::test_a_request_that_expires_while_it_waits_stops_waiting"),
    Mutant("reconnect-keeps-grant", "28. a grant Celery dropped unrun at a broker reconnection (the request waited for "
           "a pool process) is kept: nobody claims it, the key stays held until the message comes back (found by "
           "tests/faults/test_broker_faults.py first; the simulator's held-aside-reconnect since)",
           "worker/agent.py",
           "                    if wait is not None and wait.claimer is None:\n                        self._unless_claimed(wait)\n",
           "                    pass\n"),
    Mutant("reconnect-republishes-parked", "29. at a broker reconnection, requests parked next in line in pool processes "
           "are told to publish themselves again, into the broker that has just gone: lost (found by "
           "tests/faults/test_broker_faults.py first; the simulator's held-aside-reconnect since)",
           "worker/wait_outside_pool.py",
           "        if restarting:\n            return  # next in line in the pool: still listed (paths), still waiting for grants\n",
           ""),
    Mutant("finished-by-id", "30. the end of a delivery is told by task id alone: a retry with no countdown that "
           "waits already has its wait ended by its first delivery's end, and waits for good",
           "worker/agent_requests.py",
           "        if wait is None or wait.done or (seq is not None and wait.seq != seq):\n",
           "        if wait is None or wait.done:\n",
           killer="tests/worker/test_deliveries.py::test_the_end_of_a_delivery_does_not_end_the_next_delivery_of_its_task_id"),
    Mutant("blind-consumer-start", "31. a consumer (re)start connects to its agent blindly: with the agent dead and its "
           "restart waiting for ZooKeeper, a broker reconnection fails the start again and again, for good",
           "worker/agent_connection.py",
           "        except OSError as exc:\n",
           "        except ZeroDivisionError as exc:\n",
           killer="-mslow tests/faults/test_broker_faults.py::"
                  "test_a_worker_whose_agent_died_while_zookeeper_was_down_consumes_after_a_broker_reconnection"),
    Mutant("reader-forgotten", "32. the agent's reader is not registered again when the event loop restarts: after a "
           "broker reconnection grants are read only by the 0.4 s liveness check",
           "worker/agent_connection.py",
           "            hub.add_reader(outbox.sock.fileno(), self._readable)\n            outbox.register(hub)\n",
           "            outbox.register(hub)\n",
           killer="tests/worker/test_prefetch_accounting.py::"
                  "test_the_agents_reader_is_registered_again_at_every_start_of_the_event_loop"),
    Mutant("grace-by-epoch", "33. a suspension's grace judged by the connection's epoch: a reconnection whose "
           "re-verification is cut off again leaves no grace running, and the partition goes unreported",
           "engine/attempt.py",
           "            if self._attempt.state is State.HELD_SUSPENDED and self._suspension == suspension:\n",
           "            if self._attempt.state is State.HELD_SUSPENDED and self._monitor.epoch == _epoch:\n",
           killer="tests/engine/test_lock_faults.py::"
                  "test_a_suspension_that_resumes_during_reverification_keeps_its_grace"),
    Mutant("lost-node-kept-on-reacquire", "34. the owner acquiring again after a hold lost by its grace (session alive) "
           "leaves the old node at the head of the queue: it waits behind itself, and everyone with it",
           "engine/lock.py",
           "                if self._attempt is not None:\n                    self._attempt.release()\n",
           "",
           killer="tests/engine/test_lock_faults.py::test_acquiring_again_after_a_lost_hold_removes_its_node_first"),
    Mutant("granted-then-raised", "35. an exception that lands in acquire() after the grant leaves the node held by nobody",
           "engine/lock.py",
           "                attempt.release()\n            self._settle(attempt)\n",
           "                pass\n            self._settle(attempt)\n",
           killer="tests/engine/test_lock_basic.py::"
                  "test_an_exception_as_the_lock_is_granted_leaves_no_node_held_by_nobody"),
    Mutant("cancel-lost-at-start", "36. a cancel() that comes as acquire() starts its attempt reaches the previous one: lost",
           "engine/lock.py",
           "        if self._cancelled:  # cancel() came as the attempt started: it reached the previous one\n"
           "            attempt.cancel()\n",
           "",
           killer="tests/engine/test_lock_basic.py::test_a_cancel_that_comes_as_the_acquire_starts_is_not_lost"),
    Mutant("ghost-look-unpending", "37. the look for a ghost (a create whose reply was lost) clears the attempt's "
           "pending work before it is answered: a cancel meanwhile seals the cleanup and the ghost stays",
           "engine/attempt.py",
           "        self.pending = Pending.GHOST\n        self.ghosts.look(self._next_look())\n",
           "        self.pending = None\n        self.ghosts.look(self._next_look())\n",
           killer="tests/engine/test_lock_faults.py::test_a_cancel_while_a_ghost_is_looked_for_still_deletes_the_ghost"),
    Mutant("busy-partition-unseen", "38. no watch on unanswered requests: kazoo pings only when idle, so a client "
           "that keeps sending (an agent renewing leases) never notices a silent partition, and its holders run "
           "on past their session's expiry",
           "engine/session.py",
           "        elif now - since >= limit:\n",
           "        elif False:\n",
           killer="tests/engine/test_lock_faults.py::test_a_silent_partition_of_a_busy_client_is_reported"),
    Mutant("revoked-by-name", "39. a revoked or expired guarded task waiting in the pool: the guard's end looks for "
           "the app on the request's task, which is only its name, and never starts: the key's publishes are deduped "
           "into a task that will never run",
           "enqueue.py",
           '    app = getattr(sender, "app", None)\n    if app is None:\n',
           '    app = getattr(getattr(request, "task", None), "app", None)\n    if False:\n',
           killer="tests/test_enqueue.py::test_revoking_a_countdown_task_ends_its_guard_waiting_in_the_pool"),
    Mutant("dedupe-drops-callbacks", "40. a publish carrying callbacks, a chain's rest or a group's membership is "
           "deduped: the queued task runs without them, and the chain waits for good",
           "enqueue.py",
           "        if not carried:\n",
           "        if True:\n",
           killer="tests/test_enqueue.py::test_a_publish_that_carries_more_work_is_never_deduped"),
    Mutant("later-forgets-unrun", "41. a guard released in the background (ZooKeeper was away when its task ended "
           "unrun) drops the count of the work deduped into it: nothing republished, nothing said",
           "enqueue.py",
           "                then(gone)\n",
           "                pass\n",
           killer="tests/test_enqueue_no_loss.py::test_the_unrun_step_follows_a_release_tried_again_in_the_background"),
    Mutant("takeover-loses-count", "42. a retry's takeover of its guard starts the deduped count over: the work "
           "deduped before the retry goes unreported and unrepublished when the retry ends unrun",
           "engine/guard_counts.py",
           "        return self.zxid == guard_zxid or (bool(task_id) and self.task_id == task_id)\n",
           "        return self.zxid == guard_zxid\n",
           killer="tests/test_enqueue_no_loss.py::test_work_deduped_before_a_retry_takes_the_guard_over_is_republished"),
    Mutant("reserve-before-send", "43. the wrapped scheduler advances an entry before its tick is recorded and sent, "
           "as Celery does: a database scheduler's row then says sent for a tick kept due (a one-off is disabled "
           "unsent), and a rebuilt heap finds stale copies of entries already sent",
           "beat/scheduler.py",
           "        self.inner.reserve = _unadvanced\n",
           "",
           killer="tests/beat/test_django_beat.py::"
                  "test_a_failing_tick_write_resends_no_other_tick_and_sends_a_one_off_once"),
    Mutant("adopt-forgets-unsure", "44. a beat leading again forgets the tick it recorded before its reply was lost, "
           "and never publishes it",
           "beat/scheduler.py",
           "            if record.nonce == unsure.get(name):\n",
           "            if False:\n",
           killer="tests/beat/test_scheduler.py::"
                  "test_a_tick_whose_reply_was_lost_is_published_when_the_same_beat_leads_again"),
    Mutant("beat-asked-session", "45. the beat trusts a tick's proof for a third of the session it asked for, not "
           "the one the server granted: a deposed leader may publish after another was elected",
           "beat/scheduler.py",
           "        return min(self.settings.session_timeout, kazoo_compat.session_timeout(self._started_election.client))\n",
           "        return self.settings.session_timeout\n",
           killer="tests/beat/test_scheduler.py::"
                  "test_the_publish_window_follows_the_session_timeout_the_server_granted"),
    Mutant("duplicate-claims-by-id", "46. a second delivery of a task id whose first waits in the agent claims the "
           "agent's request by that id: it runs on the first's grant while the first starts on the same grant, carried",
           "task.py",
           "        if call.direct or nested is not None or self.acks_late or not req.id or bypassed:\n",
           "        if call.direct or nested is not None or self.acks_late or not req.id:\n",
           killer="tests/worker/test_duplicate_delivery.py::test_two_deliveries_of_one_task_id_never_run_at_once"),
    Mutant("bound-judged-at-release", "47. a streak's bound judged only when a handoff is decided, not again when its "
           "write answers: handoffs decided before another contender was seen (their replies held back by a "
           "partition) all go through, past the bound",
           "worker/cohort.py",
           "            if self._passes_on(slot, now, wait):\n",
           "            if True:\n",
           killer="tests/worker/test_cohort_streak.py::"
                  "test_a_handoff_decided_before_a_contender_was_seen_is_judged_again_at_its_proofs_answer"),
    Mutant("free-node-unpumped", "48. a node granted while disconnected, whose waiter left meanwhile, is verified "
           "again and kept: held by nobody, it blocks the key for every worker until another request comes",
           "worker/agent_requests.py",
           "            if cohort.wants_pump:\n",
           "            if cohort.queue and not cohort.busy:\n",
           killer="tests/worker/test_free_node_after_suspension.py::test_a_node_verified_after_its_waiter_left_is_let_go"),
    Mutant("overdue-joins-on", "49. a multi-key request granted its first key after its deadline waits on its next "
           "key with no deadline, holding the first",
           "worker/agent_requests.py",
           "        if wait.expired and wait.current is cohort:\n",
           "        if False:\n",
           killer="tests/worker/test_wait_deadline.py::"
                  "test_a_multi_key_wait_past_its_deadline_does_not_wait_on_its_next_key"),
    Mutant("stalled-create-decides", "50. a request on a new key while ZooKeeper is unreachable waits for its node's "
           "first answer past its deadline, for as long as ZooKeeper stays away",
           "worker/cohort.py",
           "        return sum(1 for s in self.slots if s.holder is None and not s.answered and s.attempt.pending is None)\n",
           "        return sum(1 for s in self.slots if s.holder is None and not s.answered)\n",
           killer="tests/worker/test_wait_deadline.py::"
                  "test_a_wait_while_zookeeper_is_unreachable_ends_unavailable_at_its_deadline"),
    Mutant("check-reply-ignored", "51. a lease's proof (a check of the node in a multi) reads the multi's reply as "
           "success whatever it holds: a node an operator deleted is proved ours, and handed on locally beside "
           "the contender that holds the key now",
           "engine/kazoo_compat.py",
           "        if isinstance(reply, Exception):\n            return checked.set_exception(reply)\n",
           "",
           killer="tests/worker/test_cohort_own_node.py::"
                  "test_a_proof_of_a_node_deleted_before_its_watch_is_set_reports_it_lost"),
    Mutant("sequence-digits", "52. queue order by the sequence's value alone, not modulo its wrap: past 2**31 - 1 "
           "ZooKeeper names the next node -2147483648, which then queues ahead of every node before it",
           "engine/driver.py",
           "            distance = (seq - origin) % SEQUENCE_WRAP - HALF_WRAP\n",
           "            distance = seq - mine\n"),
    Mutant("sequence-unparsed", "53. a sequence past the wrap (-000000001 .. -999999999) not read as a lock node: "
           "its own node missing from the queue, an attempt queues again and again, leaving nodes behind",
           "engine/znodes.py",
           "        return -int(tail[1:])  # -000000001 .. -999999999\n",
           "        return None\n"),
    Mutant("sequence-zero-holds", "54. a node of sequence 0 taken to hold without reading the queue, wherever it "
           "was made: only a node made in one multi with its container is alone there; past the second wrap "
           "(-1 to 0) a node of sequence 0 queues behind the nodes of -1, -2 ..., and would hold beside them",
           "engine/attempt.py",
           "            if listed is Queue.FRESH and znodes.sequence_of(name) == 0:\n",
           "            if znodes.sequence_of(name) == 0:\n"),
    # The worker's main process for real against a Redis broker model (issue 59 item 6):
    Mutant("lease-not-applied", "55. a held message's lease renewal never lowers its score (ZADD GT): the lease is "
           "never applied, and a killed worker's held requests wait out the visibility timeout",
           "worker/held_lease.py",
           "                pipe.zadd(key, {tag: score}, xx=True, ch=True)\n",
           "                pipe.zadd(key, {tag: score}, xx=True, ch=True, gt=True)\n"),
    Mutant("hand-over-unchecked", "56. the hand-over of a held request skips its lease check (leases.ours): a worker "
           "that stalled past its lease runs the held delivery of a message the sweep gave back, and its next "
           "delivery runs too",
           "worker/wait_outside_pool.py",
           "        ours = self.leases.ours(req)\n",
           "        ours = True\n"),
    Mutant("redelivery-bypassed", "57. the same message redelivered to the worker that holds it (same tag: its lease "
           "lapsed in a stall) takes the bypass path: it runs in-process, and the held delivery, its lease renewed "
           "on the new one's entry, runs when granted",
           "worker/wait_outside_pool.py",
           "        if held is not None and delivery_tag(held) == delivery_tag(req):\n",
           "        if False:\n"),
    Mutant("answer-by-id", "58. the agent's answers applied by task id alone (their seq not checked): a verdict or "
           "next for a delivery swept back during a stall decides the same message's new delivery (the simulator's "
           "first finding on the held-aside path: a claim pending for good, or a grant held for nobody)",
           "worker/wait_outside_pool.py",
           "        return req is None or _seq(req) in (None, seq)\n",
           "        return True\n"),
    Mutant("lease-ends-at-hand-over", "59. a held message's lease ends when it is handed to the pool, not when a pool "
           "process takes it (its ack): one granted while every process is busy waits in the pool's queue unleased, "
           "is swept back, delivered again and run twice where no result tells the copy (found by a real-broker test "
           "first, Redis out of reach twice; since then by tests/worker/test_held_aside.py::"
           "test_redis_a_granted_request_waiting_for_a_busy_pool_keeps_its_lease and the simulator's "
           "held-aside-busy-pool)",
           "worker/wait_outside_pool.py",
           "            lock_waiting.ended(req.task)\n\n    def _taken_back(",
           "            lock_waiting.ended(req.task)\n        self.leases.let_go(req)\n\n    def _taken_back("),
    # Broker reconnections and RabbitMQ (issue 59 item 6, scenarios held-aside-reconnect and
    # held-aside-rabbitmq-cut):
    Mutant("reconnect-keeps-held", "60. at a broker reconnection (stop with the blueprint in RUN) the requests held "
           "aside are kept, their waits left in the agent: granted after the reconnection, they are handed to the "
           "pool from the lost connection's deliveries, whose messages the broker has back (RabbitMQ requeued them "
           "at once): run twice",
           "worker/wait_outside_pool.py",
           "        held = [*self.ticks.take_all(), *self.aside.values()]\n",
           "        if restarting:\n            return\n        held = [*self.ticks.take_all(), *self.aside.values()]\n"),
    Mutant("success-unknown", "61. redelivery.earlier_run reads SUCCESS as saying nothing: the redelivered copy of an "
           "acks-early task whose ack was lost with its connection (its body began in a pool process as the "
           "connection dropped) runs again after the first run finished",
           "redelivery.py",
           "    if state in states.READY_STATES or state == SKIPPED:\n",
           "    if state in states.READY_STATES - {states.SUCCESS} or state == SKIPPED:\n"),
    Mutant("rejects-counted", "62. a warm shutdown's stop counts the rejects it attempted as tasks gone back to the "
           "broker: with the connection lost as the shutdown begins, none went back, and the log says they did "
           "(issue 59 item 5)",
           "worker/wait_outside_pool.py",
           "            returned = sum(returned_to_broker(req) for req in held)\n",
           "            returned = sum(returned_to_broker(req) or True for req in held)\n"),
    # Read/write locks (issue 62), found in the scenarios readers-writers, readers-writers-wrap
    # and readers-beside-a-worker (the random seeds have no readers):
    Mutant("reader-ignores-writer", "63. a reader takes a writer's node ahead of it for a reader's: it reads beside "
           "the write hold, or ahead of a waiting writer",
           "engine/driver.py",
           "            if not is_shared(name) and (nearest is None or distance > nearest[0]):\n",
           "            if not is_shared(name) and \"__WRIT__\" not in name and (nearest is None or distance > nearest[0]):\n"),
    Mutant("writer-watches-like-a-reader", "64. a writer watches what a reader would (the nearest exclusive node ahead): "
           "with only readers left ahead it watches nothing, and waits for good though first in line",
           "engine/internals.py",
           "            return reader_gets_the_lock(children, node)\n"
           "        return gets_the_lock(children, node, self.max_holders)\n",
           "            return reader_gets_the_lock(children, node)\n"
           "        if self.kind is znodes.NodeKind.WRITE:\n"
           "            return gets_the_lock(children, node, 1)._replace(watch=reader_gets_the_lock(children, node).watch)\n"
           "        return gets_the_lock(children, node, self.max_holders)\n"),
    Mutant("rlock-exclusive", "65. kazoo's read nodes (__rlock__) read as exclusive: our readers wait for kazoo's "
           "readers",
           "engine/znodes.py",
           "    return name.endswith(SHARED_MARKERS, 0, -10) or name.endswith(SHARED_MARKERS, 0, -11)\n",
           "    return name.endswith(\"__READ__\", 0, -10) or name.endswith(\"__READ__\", 0, -11)\n"),
    Mutant("reader-digits", "66. a reader orders the queue by the sequence's value, not modulo its wrap: past "
           "2**31 - 1 a writer queued just before the wrap is behind it, and it reads beside that write",
           "engine/driver.py",
           "            continue\n        distance = (seq - origin) % SEQUENCE_WRAP - HALF_WRAP\n",
           "            continue\n        distance = seq - mine\n"),
    # Where the lock meets the broker, after a reconnection (scenario held-aside-reconnect):
    Mutant("dead-channel-acks", "67. at a Redis reconnection the messages of the tasks that were running, or "
           "already written to a pool process, stay on the channel lost with the connection: Celery acknowledges "
           "them there after the reconnection, kombu raises AttributeError on that closed channel, and the worker "
           "exits with every queued task unrun (found by a slow real-broker fault test first, "
           "test_broker_restarted_mid_run_with_acks_late; since then by tests/worker/test_held_aside.py::"
           "test_a_task_that_ends_while_redis_is_away_is_acknowledged_once_it_is_back)",
           "worker/dead_channel.py",
           "        moved = [req for dead in self._dead for req in dead.move_to(live)] if live is not None else []\n",
           "        moved = []\n"),
    Mutant("early-push-last", "68. a pool process's lock applies a state pushed before it registered after one the "
           "link's thread delivered as it registered: it reads held while its agent last said suspended "
           "(the simulator models the pool process, not AgentLock: found by a test)",
           "worker/agent_client.py",
           "            if place <= self._last_push:\n                return\n",
           "            pass\n",
           killer="tests/worker/test_grant_delivery.py::"
                  "test_a_state_pushed_before_registration_never_overrides_a_newer_one"),
    Mutant("stale-push-kept", "69. a state pushed to a lock as it let go is kept for its id and applied to the next lock "
           "of that id (a retry keeps its task's id): the new lock reads suspended, and its body waits a session "
           "timeout for a \"held\" that never comes (found by a test: the simulator models the pool process)",
           "worker/agent_client.py",
           "                    self._early.pop(msg.id, None)\n",
           "                    pass\n",
           killer="tests/worker/test_grant_delivery.py::"
                  "test_a_state_pushed_to_an_earlier_lock_of_the_same_id_is_not_applied_to_the_next"),
]

#: Planted bugs that wait for a finding's fix before a scenario can prove them (none now):
#: ``python -m sim.mutants --pending`` applies them (each must still apply).
PENDING: list[Mutant] = []


def apply(mutant: Mutant, package: Path) -> None:
    target = package / mutant.path
    text = target.read_text()
    if text.count(mutant.old) != 1:
        raise SystemExit(f"mutant {mutant.name}: its target text occurs {text.count(mutant.old)} times in "
                         f"celery_zklock/{mutant.path} (expected once): update sim/mutants.py")
    target.write_text(text.replace(mutant.old, mutant.new))


def hunt(mutant: Mutant, seeds: int) -> tuple[Mutant, int | None, float, str]:
    """Run the simulator against a mutated copy: (mutant, seed found or None, seconds, line)."""
    with tempfile.TemporaryDirectory(prefix=f"zklock-mutant-{mutant.name}-") as tmp:
        shutil.copytree(ROOT / "celery_zklock", Path(tmp) / "celery_zklock",
                        ignore=shutil.ignore_patterns("__pycache__"))
        apply(mutant, Path(tmp) / "celery_zklock")
        env = {**os.environ, "PYTHONPATH": f"{tmp}{os.pathsep}{ROOT}", "PYTHONHASHSEED": "0",
               "ZKLOCK_PACKAGE_COPY": tmp}  # a killer test's workers run the copy too (support.workers)
        started = time.monotonic()
        if mutant.killer:
            return (mutant, *_killed(mutant, tmp, env, started))
        proc = subprocess.run([sys.executable, "-m", "sim.run", "--seeds", str(seeds), "--quiet", "--no-shrink"],
                              cwd=tmp, env=env, capture_output=True, text=True)
        elapsed = time.monotonic() - started
        found = re.search(r"VIOLATION at seed (\d+)( \(scenario [\w-]+\))?: (.*)", proc.stdout)
        if found:
            return mutant, f"{found.group(1)}{found.group(2) or ''}", elapsed, found.group(3)[:160]
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["?"]
            return mutant, None, elapsed, f"the run failed: {tail[0][:160]}"
        return mutant, None, elapsed, ""


def _killed(mutant: Mutant, tmp: str, env: dict, started: float) -> tuple[str | None, float, str]:
    """Its killer tests against the mutated copy: (the first failed test or None, seconds,
    line).  Run from the copy's directory, which is then first on ``sys.path``, with the
    checkout appended (``--import-mode=append``) for the tests and their helpers."""
    where = subprocess.run([sys.executable, "-c", "import celery_zklock; print(celery_zklock.__file__)"],
                           cwd=tmp, env=env, capture_output=True, text=True).stdout.strip()
    if not where.startswith(tmp):
        return None, time.monotonic() - started, f"the tests would import {where or '?'}, not the mutated copy"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--import-mode=append",
                           f"--rootdir={ROOT}", *(t if t.startswith("-") else str(ROOT / t) for t in mutant.killer.split())],
                          cwd=tmp, env=env, capture_output=True, text=True)
    elapsed = time.monotonic() - started
    failed = re.findall(r"^FAILED (\S+)", proc.stdout, re.M)
    if proc.returncode == 1 and failed:
        return failed[0].split("::")[-1], elapsed, f"{len(failed)} test(s) failed"
    errors = re.findall(r"^ERROR (\S+)", proc.stdout, re.M)
    if proc.returncode == 1 and errors:  # a fixture failed (under load, say): the mutant was never judged
        return None, elapsed, (f"not judged (still counted as surviving): {len(errors)} test(s) errored in "
                               f"set-up or teardown ({errors[0].split('::')[-1]})")
    if proc.returncode not in (0, 1):
        tail = (proc.stdout or proc.stderr).strip().splitlines()[-1:] or ["?"]
        return None, elapsed, f"the tests could not run: {tail[0][:160]}"
    return None, elapsed, ""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sim.mutants", description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
    parser.add_argument("--seeds", type=int, default=CI_SEEDS, help="seeds per mutant (the CI budget)")
    parser.add_argument("--jobs", type=int, default=max(1, min(4, os.cpu_count() or 1)))
    parser.add_argument("--pending", action="store_true", help="the mutants that wait for a finding's fix (PENDING)")
    args = parser.parse_args(argv)
    chosen = [m for m in (PENDING if args.pending else MUTANTS) if not args.names or m.name in args.names]
    for mutant in chosen:  # every mutant must still apply before any runs
        with tempfile.TemporaryDirectory() as tmp:
            shutil.copytree(ROOT / "celery_zklock" / Path(mutant.path).parent, Path(tmp) / Path(mutant.path).parent,
                            dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
            apply(mutant, Path(tmp))
    started = time.monotonic()
    survivors = []
    with ThreadPoolExecutor(args.jobs) as pool:
        for mutant, seed, elapsed, line in pool.map(lambda m: hunt(m, args.seeds), chosen):
            if seed is None:
                survivors.append(mutant)
                print(f"SURVIVED {mutant.name:20s} {args.seeds} seeds, {elapsed:6.1f} s  {line}  ({mutant.why})")
            else:
                where = f"by {seed}" if mutant.killer else f"at seed {seed:>4}"
                print(f"found    {mutant.name:20s} {where}, {elapsed:6.1f} s: {line}", flush=True)
    print(f"sim-mutants: {len(chosen) - len(survivors)}/{len(chosen)} found (the simulator's within {args.seeds} "
          f"seeds each, the others by their tests), "
          f"{time.monotonic() - started:.0f} s")
    return 1 if survivors else 0


if __name__ == "__main__":
    raise SystemExit(main())
