"""One acquisition of a lock (Curator's ``LockInternals``): a path and its collaborators.

* :mod:`.machine` — the :class:`~.machine.Attempt`, read top to bottom: start, create,
  decide, watch the ones ahead, take, hold, release; giving up and coming back;
* :mod:`.parents` — :class:`~.parents.KeyParent`, the key's container znode;
* :mod:`.ghosts` — :class:`~.ghosts.Ghosts`, a create whose reply was lost (adopt or delete);
* :mod:`.holding` — :class:`~.holding.HoldWatch`, suspension, grace and the own-node watch;
* :mod:`.state` — the :class:`~.state.State` and :class:`~.state.Pending` enums.

The pure decision is :func:`celery_zklock.engine.driver.gets_the_lock`.
"""
