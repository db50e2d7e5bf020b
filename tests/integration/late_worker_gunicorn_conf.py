"""A gunicorn config file (``gunicorn -c``, not a test module): deploy/gunicorn.conf.py,
except that every worker after the first warms only once its master has told it to stop
(or after a minute): the interleaving in which the first worker's failed boot halts the
master while another worker is still warming. Importing it reads deploy's settings and
defines the hook, nothing more (pytest's doctest collection imports it)."""

import runpy
import time
from pathlib import Path

_deploy = runpy.run_path(str(Path(__file__).parents[2] / "deploy" / "gunicorn.conf.py"))
globals().update({k: v for k, v in _deploy.items() if not k.startswith("__")})
_warm = _deploy["post_worker_init"]


def post_worker_init(worker):
    if worker.age > 1:
        deadline = time.monotonic() + 60
        while worker.alive and time.monotonic() < deadline:
            time.sleep(0.05)
    _warm(worker)
