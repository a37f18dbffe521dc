"""A minimal Django project whose beats run ZkScheduler around django-celery-beat's
DatabaseScheduler (tests/beat/test_django_beat.py); settings come from the environment."""
