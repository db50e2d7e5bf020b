"""How a process serves: ``embedsvc serve``, the waitress adapter, the gunicorn worker, the
probe listener, the process model and the preflight checks."""
