"""The fenced store the workload writes to, and the history it leaves behind.

Why a store of our own: a lock is only as good as what it protects.  Each task run reads a
per-key counter and later writes counter+1, both through one Lua script that accepts an
operation only when the run's fencing token is >= the last token the key has seen
(Kleppmann's fencing).  The same script appends every operation, accepted or not, to one
Redis list: RPUSH order is the order Redis executed the scripts in, so the history has a
single total order (``seq``) and one clock (Redis ``TIME``) — no reasoning about the
clocks of several worker processes.

This Redis is *not* the broker: the broker fault restarts the broker, and the history must
survive it.
"""

from __future__ import annotations

import json

import redis

HISTORY = "faults:history"

# KEYS[1]: history list, KEYS[2]: fence hash of the lock key.
# ARGV: op, key, task id, token, worker, pid, value to write ("end" only).
# "begin" is the fenced read, "end" the fenced write; "return" (the body returned) and
# "mark" (free-form) are only logged.
_SCRIPT = """
local now = redis.call('TIME')
local t = tonumber(now[1]) * 1000000 + tonumber(now[2])
local op = ARGV[1]
local token = tonumber(ARGV[4])
local ok = 1
local value = tonumber(redis.call('HGET', KEYS[2], 'value') or '0')
if op == 'begin' or op == 'end' then
  local last = tonumber(redis.call('HGET', KEYS[2], 'token') or '-1')
  if token < last then
    ok = 0
  else
    redis.call('HSET', KEYS[2], 'token', ARGV[4])
    if op == 'end' then
      value = tonumber(ARGV[7])
      redis.call('HSET', KEYS[2], 'value', ARGV[7])
    end
  end
end
local event = cjson.encode({op = op, key = ARGV[2], task = ARGV[3], token = ARGV[4], worker = ARGV[5],
                            pid = tonumber(ARGV[6]), ok = ok, value = value, sec = now[1], usec = now[2]})
local seq = redis.call('RPUSH', KEYS[1], event)
return {ok, value, t, seq}
"""


class Store:
    """Client side of the fenced store; one per process."""

    def __init__(self, url: str) -> None:
        self.redis = redis.Redis.from_url(url)
        self._script = self.redis.register_script(_SCRIPT)

    def op(self, op: str, key: str, task: str, token: int | None, worker: str, pid: int,
           value: int = 0) -> tuple[bool, int, int]:
        """Run one operation; returns (accepted, counter value, Redis time in µs)."""
        ok, current, t, _seq = self._script(
            keys=[HISTORY, f"faults:fence:{key}"],
            args=[op, key, task, -1 if token is None else token, worker, pid, value],
        )
        return bool(ok), int(current), int(t)

    def events(self) -> list[dict]:
        """The history in execution order; ``seq`` is each event's position."""
        rows = [json.loads(x) for x in self.redis.lrange(HISTORY, 0, -1)]
        for seq, row in enumerate(rows):
            row["seq"] = seq
            row["token"] = int(row["token"])
            row["t"] = int(row.pop("sec")) + int(row.pop("usec")) / 1e6  # cjson would round a µs integer
        return rows

    def now(self) -> float:
        """Redis time in seconds, the clock every history event is stamped with."""
        sec, usec = self.redis.time()
        return sec + usec / 1e6

    def reset(self) -> None:
        self.redis.flushdb()
