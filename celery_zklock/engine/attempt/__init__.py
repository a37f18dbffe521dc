"""One acquisition of a lock (Curator's ``LockInternals``): a path and its collaborators.

* :mod:`.machine` — the :class:`~.machine.Attempt`, read top to bottom: start, create,
  decide, watch the ones ahead, take, hold, release; giving up and coming back; and what
  it does with each collaborator's answer;
* :mod:`.parents` — :class:`~.parents.KeyParent`, the key's container znode;
* :mod:`.ghosts` — :class:`~.ghosts.Ghosts`, a create whose reply was lost (adopt or delete);
* :mod:`.holding` — :class:`~.holding.HoldWatch`, suspension, grace and the own-node watch;
* :mod:`.state` — the :class:`~.state.State` and :class:`~.state.Pending` enums, and the
  :class:`~.state.AttemptView` the collaborators read.

The pure decisions are :func:`celery_zklock.engine.driver.gets_the_lock` (the queue),
:func:`.parents.multi_answered`, :func:`.ghosts.resolve` and :func:`.holding.verified`.
"""
