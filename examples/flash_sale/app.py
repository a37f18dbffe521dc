"""Flash sale: ``buy`` tasks serialized per SKU, stock writes fenced with the lock's token.

The checkout does a plain read-modify-write of the SKU's stock in Redis (read, do some work,
write the new value).  Two buyers of the same SKU running at once would both read 5 and both
write 4: an oversell.  ``lock_key="sku:{sku_id}"`` makes the buyers of one SKU take turns
(FIFO) while different SKUs sell in parallel.

The write itself goes through a Lua script that is *fenced*: it remembers the highest
fencing token it has accepted for the SKU and rejects a lower one, so a former holder that
was paused (GC, SIGSTOP, a partition) past the loss of its lock cannot overwrite a newer
holder's write.  It also refuses to make stock negative.  In a healthy run neither
rejection happens; they are counted so that the run can prove it.

Run with workers: ``celery -A examples.flash_sale.app worker -c 3`` (see ``python -m
examples.flash_sale`` or ``make demo``).
"""

from __future__ import annotations

import json
import os
import time

from celery_zklock import ZkLockedTask, current_lock
from examples.common import Store, make_app

app = make_app("flash_sale")
store = Store("flash")


# Keys of one SKU share a {hash tag} so the script's keys live in one Redis Cluster slot.
def stock_key(sku_id: str) -> str:
    return store.key("{%s}" % sku_id, "stock")


def fence_key(sku_id: str) -> str:
    return store.key("{%s}" % sku_id, "fence")


def orders_key(sku_id: str) -> str:
    return store.key("{%s}" % sku_id, "orders")


def stats_key(sku_id: str) -> str:
    return store.key("{%s}" % sku_id, "stats")


def observations_key() -> str:
    return store.key("observations")


# KEYS[1] stock, KEYS[2] highest token accepted (the fence), KEYS[3] accepted orders (list),
# KEYS[4] stats (hash).  ARGV[1] fencing token, ARGV[2] new stock value, ARGV[3] order id.
# Tokens are czxid << 8 | grant (celery_zklock.engine.znodes.fencing_token): exact as Lua doubles below 2^53.
FENCED_WRITE = """
local token = tonumber(ARGV[1])
local new_stock = tonumber(ARGV[2])
local last = tonumber(redis.call('GET', KEYS[2]) or '-1')
if token < last then
  redis.call('HINCRBY', KEYS[4], 'fenced_rejections', 1)
  return {'fenced', tostring(last)}
end
if new_stock < 0 then
  redis.call('HINCRBY', KEYS[4], 'negative_rejections', 1)
  return {'negative', redis.call('GET', KEYS[1]) or '0'}
end
redis.call('SET', KEYS[2], ARGV[1])
redis.call('SET', KEYS[1], new_stock)
redis.call('RPUSH', KEYS[3], ARGV[3] .. '@' .. ARGV[1])
local low = redis.call('HGET', KEYS[4], 'lowest_stock')
if (not low) or new_stock < tonumber(low) then
  redis.call('HSET', KEYS[4], 'lowest_stock', new_stock)
end
return {'ok', tostring(new_stock)}
"""

_script = None


def fenced_write(sku_id: str, token: int, new_stock: int, order_id: str) -> tuple[str, int]:
    """Write ``new_stock`` unless ``token`` is older than the last accepted one (or stock < 0)."""
    global _script
    if _script is None:
        _script = store.r.register_script(FENCED_WRITE)
    status, value = _script(keys=[stock_key(sku_id), fence_key(sku_id), orders_key(sku_id), stats_key(sku_id)],
                            args=[token, new_stock, order_id])
    return status.decode(), int(value)


def set_stock(stock: dict[str, int]) -> None:
    """Open the sale: initial stock per SKU, fences and order lists reset."""
    pipe = store.r.pipeline()
    for sku_id, qty in stock.items():
        pipe.delete(fence_key(sku_id), orders_key(sku_id), stats_key(sku_id))
        pipe.set(stock_key(sku_id), qty)
    pipe.delete(observations_key())
    pipe.execute()


#: FLASH_SALE_UNLOCKED=1 runs the same body with no lock at all (``make bench``'s unsafe
#: ceiling: it oversells, and its write is not fenced).
LOCKED = os.environ.get("FLASH_SALE_UNLOCKED") != "1"
_LOCKING = dict(base=ZkLockedTask, lock_key="sku:{sku_id}", lock_timeout=30, on_lock_timeout="retry",
                lock_retry_countdown=0.5) if LOCKED else {}


class _NoLock:
    token, wait = 0, 0.0


@app.task(bind=True, **_LOCKING)
def buy(self, sku_id: str, order_id: str, qty: int = 1, work_ms: float = 1.0) -> str:
    lock = current_lock() if LOCKED else _NoLock  # held: we are the only buyer of this SKU right now
    started = time.time()
    r = store.r

    stock = int(r.get(stock_key(sku_id)) or 0)
    if stock < qty:
        outcome = "sold_out"
    else:
        time.sleep(work_ms / 1000)  # price check, payment hold...: the read-modify-write window
        status, _ = fenced_write(sku_id, lock.token, stock - qty, order_id)
        outcome = {"ok": "accepted", "fenced": "fenced", "negative": "negative"}[status]
    ended = time.time()
    enqueued_at = getattr(self.request, "enqueued_at", None)  # message header set by the sender
    r.rpush(observations_key(), json.dumps({
        "order": order_id,
        "sku": sku_id,
        "outcome": outcome,
        "token": lock.token,
        "start": started,
        "end": ended,
        "lock_wait": lock.wait,  # wherever it waited: the worker's agent or this process
        "enqueue_to_start": None if enqueued_at is None else started - float(enqueued_at),
        "retries": self.request.retries or 0,
        "worker": self.request.hostname,
        "pid": os.getpid(),
    }))
    return outcome


@app.task(base=ZkLockedTask, lock_timeout=0, on_lock_timeout="skip")
def stock_report() -> dict[str, int]:
    """Beat job (docker-compose's beat service): a stock snapshot, one at a time cluster-wide."""
    levels = {}
    for key in store.r.scan_iter(match=store.key("{*}", "stock"), count=1000):
        sku_id = key.decode().rsplit("{", 1)[1].split("}", 1)[0]
        levels[sku_id] = int(store.r.get(key) or 0)
    return levels


app.conf.beat_schedule = {
    "stock-report": {"task": "examples.flash_sale.app.stock_report", "schedule": 10.0},
}
