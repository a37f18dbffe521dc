"""Benchmarks for celery-zklock (run as scripts, not tests)."""
