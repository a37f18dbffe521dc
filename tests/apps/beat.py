"""Beat schedule for the beat test: a 1.2 s singleton job every 0.5 s, from two beats."""

from tests.apps.locked import app

app.conf.beat_schedule = {
    "singleton-every-half-second": {"task": "tests.apps.locked.singleton", "schedule": 0.5, "args": (1200, "beat")},
}
