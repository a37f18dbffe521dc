"""The beat_elected example's app on a clock ``BEAT_CLOCK_SKEW`` seconds off (beat's schedule
reads ``app.now()``): a beat host whose time sync failed, for tests/beat/test_beat_broker.py."""

from __future__ import annotations

import os
from datetime import timedelta

from examples.beat_elected.app import app, refresh_exchange_rates  # noqa: F401  (the task, for the app)

_skew = timedelta(seconds=float(os.environ.get("BEAT_CLOCK_SKEW") or 0))
_now = app.now
app.now = lambda: _now() + _skew
