"""The beat_elected example's app as one beat host may differ from the others, for
tests/beat/test_beat_broker.py: a clock ``BEAT_CLOCK_SKEW`` seconds off (beat's schedule reads
``app.now()``: a host whose time sync failed), and ``BEAT_EXTRA_ENTRY``, an entry only this
host's schedule has (a rolling deploy that added it)."""

from __future__ import annotations

import os
from datetime import timedelta

from examples.beat_elected.app import TASK, app, refresh_exchange_rates  # noqa: F401  (the task, for the app)

_skew = timedelta(seconds=float(os.environ.get("BEAT_CLOCK_SKEW") or 0))
_now = app.now
app.now = lambda: _now() + _skew
if os.environ.get("BEAT_EXTRA_ENTRY"):
    app.conf.beat_schedule = {**app.conf.beat_schedule,
                              os.environ["BEAT_EXTRA_ENTRY"]: {"task": TASK, "schedule": 3600.0}}
