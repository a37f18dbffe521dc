"""What runs inside a Celery worker: its main process, its lock agent, a pool process's link.

Why a layer of its own: these modules share one constraint the rest of the package does not
have — the prefork parent must do no ZooKeeper I/O (it forks), so the worker's one session
lives in an exec'd agent process, and the main process and pool processes talk to it over a
local socket.  They use the engine; the Celery glue uses them; nothing here imports the glue.
"""
