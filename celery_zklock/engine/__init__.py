"""The lock engine: a fair ZooKeeper lock (and semaphore) with no Celery in it.

Why a layer of its own: the protocol — sequential ephemeral nodes, watches on the
predecessor, sessions, fencing tokens — is what Curator and kazoo peers interoperate with, and
it is tested and benchmarked on its own (``FairLock`` against kazoo's ``Lock``).  It imports
only the base modules (errors, settings, keys); the worker side and the Celery glue build on
it, never the other way round (``tests/test_structure.py``).
"""
