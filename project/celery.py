"""The Celery app, configured from Django settings (CELERY_* names), as in Celery's Django example."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")

app = Celery("ceiling")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
