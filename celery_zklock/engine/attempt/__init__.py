"""One acquisition of a lock, as a state machine in pieces (Curator's ``LockInternals`` split).

Each piece is a mixin over the one :class:`~.machine.Attempt` object, so a transition
that starts in one room and ends in another still reads as one method call:

* :mod:`.state` — the small :class:`~.state.State` enum every piece moves between;
* :mod:`.machine` — start, deadline, cancel, giving up, and resuming after a reconnection;
* :mod:`.creating` — creating our node (and the key's container) in one round trip;
* :mod:`.ghosts` — resolving a create whose reply was lost (adopt or delete);
* :mod:`.waiting` — reading the queue, the driver's verdict, watches and handoffs;
* :mod:`.holding` — held, suspended, re-verified or lost, and the session's events;
* :mod:`.releasing` — letting go with a guaranteed delete.

Why mixins and not collaborator objects: the pieces share one lock (``_guard``) and one
set of fields (node, session, look counter); passing a context object between five
classes would only rename ``self``.  Each module says which fields it writes.
"""
