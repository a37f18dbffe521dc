"""Runnable examples of celery-zklock with real workers: ``make demo`` (``python -m examples.demo``).

* :mod:`examples.flash_sale` — per-SKU serialized ``buy`` tasks with fenced stock writes;
* :mod:`examples.beat_singleton` — a beat job longer than its period, sent by two beats;
* :mod:`examples.retry_on_timeout` — the retry-with-backoff policy on lock timeout.

Each example's Celery app reads its connections from the environment (``REDIS_URL``,
``ZKLOCK_HOSTS``, ``ZKLOCK_ROOT``, ``ZKLOCK_DEMO_PREFIX``; see :mod:`examples.common`).
"""
