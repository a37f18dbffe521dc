"""Compatibility harness: Celery's own integration tests, stock and with every task locked.

``make compat`` (``python -m compat.run``); see :mod:`compat.run` and :mod:`compat.plugin`.
"""
