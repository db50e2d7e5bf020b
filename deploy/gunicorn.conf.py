"""Recommended gunicorn settings for embedsvc.

    gunicorn -c deploy/gunicorn.conf.py embedsvc:app

One worker with many threads: the model is loaded once and the micro-batcher sees every
request, so concurrent requests share device batches. PyTorch releases the GIL while it
computes, so the request threads keep parsing and serialising meanwhile.

Several workers (-w N) each hold their own copy of the model and their own batcher: N times
the memory (on a GPU, N copies in device memory) and smaller batches, for no more device
throughput. Use them only on the CPU when one process cannot keep the cores busy, and then
with --preload so that the workers share the weights' pages. For several GPUs, run one
embedsvc per GPU (CUDA_VISIBLE_DEVICES=0, 1, ...) behind a load balancer instead.

Settings of embedsvc itself come from EMBEDSVC_* variables; the bind address and thread
count below read the same variables as `embedsvc serve`.
"""

import os

bind = f"{os.environ.get('EMBEDSVC_HOST', '127.0.0.1')}:{os.environ.get('EMBEDSVC_PORT', '8080')}"
worker_class = "gthread"
workers = 1
threads = int(os.environ.get("EMBEDSVC_THREADS", "16"))
# The worker warms the model in post_worker_init, before its first heartbeat: the timeout
# must cover loading the model (tens of seconds for a large one on a cold disk). Once it
# serves, the gthread worker's main loop heartbeats while threads wait on long batches.
timeout = 120
# On SIGTERM gunicorn stops accepting and gives in-flight requests this long to finish;
# keep it at or above EMBEDSVC_DRAIN_TIMEOUT_S and below the orchestrator's grace period.
graceful_timeout = 30
keepalive = 5
# A preloaded app loads the weights in the master (on the CPU only) for workers to share.
# With one worker there is nothing to share, so the model loads in the worker.
preload_app = False


def post_worker_init(worker):
    """Load and warm the model before the worker takes requests, so the first one is fast."""
    worker.wsgi.warm(timeout=timeout)
