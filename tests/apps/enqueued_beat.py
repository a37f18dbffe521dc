"""Beat schedule for the enqueue test: a 1.2 s dedupe job (until finish) ticking every 0.3 s."""

import os

from tests.apps.enqueued import app

app.conf.beat_schedule = {
    "dedupe-every-300ms": {"task": "tests.apps.enqueued.in_flight", "schedule": 0.3,
                           "args": (os.environ.get("TEST_BEAT_KEY", "beat"), 1200)},
}
