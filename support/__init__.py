"""Repository-only helpers shared by ``tests/``, ``examples/`` and ``bench/``.

Not part of the installed package (``pyproject.toml`` packages only ``celery_zklock*``):
these start throwaway servers and real ``celery worker`` / ``celery beat`` processes for
the test suite, ``make demo`` and ``make bench``, and may import test-only dependencies
(redis, pytest).  Everything here runs from a checkout, with the repository root on
``sys.path`` (``python -m ...`` from the root, pytest's rootdir, or ``PYTHONPATH``).

* :mod:`support.redis_server` -- a throwaway ``redis-server`` on a free loopback port;
* :mod:`support.console` -- progress lines and the Ctrl-C / SIGTERM handling of the
  command-line programs (demo, examples, benchmark);
* :mod:`support.workers` -- ``celery worker`` / ``celery beat`` subprocesses: start, wait
  until ready, stop exactly those (by pid and process group), logs;
* :mod:`support.services` -- reuse a reachable ZooKeeper and Redis, or start local ones
  (the demo and the examples).
"""
