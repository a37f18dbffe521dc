import os

SECRET_KEY = "tests-only"
INSTALLED_APPS = ["django_celery_beat"]
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": os.environ["DJANGO_BEAT_DB"]}}
USE_TZ = True
TIME_ZONE = "UTC"
CELERY_BROKER_URL = os.environ["REDIS_URL"]
CELERY_BEAT_SCHEDULER = "celery_zklock.beat:ZkScheduler"
CELERY_BEAT_MAX_LOOP_INTERVAL = 1.0
CELERY_ZKLOCK_BEAT_SCHEDULER = "django_celery_beat.schedulers:DatabaseScheduler"
CELERY_ZKLOCK_HOSTS = os.environ["ZKLOCK_HOSTS"]
CELERY_ZKLOCK_ROOT = os.environ["ZKLOCK_ROOT"]
CELERY_ZKLOCK_SESSION_TIMEOUT = 2.0
