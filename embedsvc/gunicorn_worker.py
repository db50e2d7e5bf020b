"""The worker path users give gunicorn: ``embedsvc.gunicorn_worker.ThreadWorker``.

The worker itself is serving/gunicorn_worker.py; this module keeps the published path."""

from .serving.gunicorn_worker import ThreadWorker

__all__ = ["ThreadWorker"]
