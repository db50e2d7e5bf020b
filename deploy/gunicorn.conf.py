"""Recommended gunicorn settings for embedsvc.

    gunicorn -c deploy/gunicorn.conf.py embedsvc:app

One worker with many threads: the model is loaded once and the micro-batcher sees every
request, so concurrent requests share device batches. PyTorch releases the GIL while it
computes, so the request threads keep parsing and serialising meanwhile.

Several workers (-w N on the command line) share one engine process, which alone holds the
model, its device and the batcher: one copy of the model, batches formed from every worker's
requests, and N processes to parse, tokenize and serialise. The first worker starts the
engine (in post_worker_init below), and it exits when the master does, even by SIGKILL; the
master preloads nothing, with or without --preload (docs/deployment.md, "One model, many
HTTP processes"). EMBEDSVC_ENGINE=inline gives each worker its own copy instead. For several
GPUs, run one embedsvc per GPU (CUDA_VISIBLE_DEVICES=0, 1, ...) behind a load balancer.

Settings of embedsvc itself come from EMBEDSVC_* variables; the bind address, threads,
connection limit, keep-alive and the worker's deadlines read the same variables as
`embedsvc serve`. EMBEDSVC_HEALTH_PORT also serves /health, /metrics and /info on a port of
their own, answerable while the main port is flooded.
"""

import math
import os

from embedsvc.settings import Settings

_settings = Settings.from_env(os.environ)  # the EMBEDSVC_* variables, checked as for serve

bind = f"{_settings.host}:{_settings.port}"
# gthread, plus deadlines for request heads, bodies and answers, the body limit before the
# app, JSON error answers and the drain of `embedsvc serve` (embedsvc/serving/
# gunicorn_worker.py); HEADER_TIMEOUT_S, BODY_TIMEOUT_S, SEND_TIMEOUT_S, MAX_BODY_BYTES and
# DRAIN_TIMEOUT_S come from the EMBEDSVC_* variables.
worker_class = "embedsvc.gunicorn_worker.ThreadWorker"
workers = 1
threads = _settings.threads
# Open connections per worker (idle and kept-alive ones hold no thread); past it the worker
# stops accepting until some close.
worker_connections = _settings.max_connections
# The worker warms the model in post_worker_init, before its first heartbeat: the timeout
# must cover loading the model (tens of seconds for a large one on a cold disk). Once it
# serves, the gthread worker's main loop heartbeats while threads wait on long batches.
timeout = 120
# On SIGTERM the worker closes its listener at once (new connections are refused, never
# queued and then reset), drains the service within EMBEDSVC_DRAIN_TIMEOUT_S (/health says
# draining, admitted requests finish) and stops the probe port. gunicorn kills a worker still
# running after graceful_timeout: the drain's time plus a margin for the last answers. Keep
# EMBEDSVC_DRAIN_TIMEOUT_S + 5 below the orchestrator's grace period.
graceful_timeout = math.ceil(_settings.drain_timeout_s) + 5
# Seconds a kept-alive connection may sit idle between requests (EMBEDSVC_IDLE_TIMEOUT_S).
keepalive = max(1, round(_settings.idle_timeout_s))
# Request line and headers: gunicorn's defaults, stated; past them a JSON 414/431/400.
limit_request_line = 4094
limit_request_fields = 100
limit_request_field_size = 8190
# gunicorn's runtime control socket defaults to one path per user, so a second gunicorn on
# the machine takes over the first one's; embedsvc does not use it.
control_socket_disable = True
# With one worker there is nothing to share, so the model loads in the worker; with -w N the
# workers share the engine process, and a preloading master would load nothing anyway.
preload_app = False


def post_worker_init(worker):
    """Load and warm the model before the worker takes requests, so the first one is fast
    (with -w N: start the shared engine process, or wait for it, and connect)."""
    worker.wsgi.warm(timeout=timeout)
