"""`embedsvc serve` as a process on the fake encoder, for tests of the server, not the model:

    python -m tests.integration.fake_serve serve --port 0 ...

Everything is the real command (settings, waitress, probes, signals, drain, exit codes, the
engine process and fronts of ``--workers N``, which are this program again) except the
encoder: a ``FakeEncoder`` at 384 dimensions that spends ``FAKE_SERVE_DELAY_S`` per batch
and ``FAKE_SERVE_PER_TOKEN_S`` per padded token in ``time.sleep`` (the GIL released, as during
device work), so that a test can catch a batch computing. Starting it costs a fraction of a
second of CPU, not a model load; ``FAKE_SERVE_LOAD_S`` makes its load take that long (a
sleep), so that a test can catch the model loading.
"""

from __future__ import annotations

import os
import sys
import time

from embedsvc.cli import main
from embedsvc.model import backend
from embedsvc.model.fake import FakeEncoder


def run() -> int:
    """``embedsvc`` with this process's arguments, its model the fake encoder."""
    encoder = FakeEncoder(dimension=384, max_input_tokens=256, record=False,
                          delay_s=float(os.environ.get("FAKE_SERVE_DELAY_S", "0")),
                          per_token_s=float(os.environ.get("FAKE_SERVE_PER_TOKEN_S", "0")))
    load_s = float(os.environ.get("FAKE_SERVE_LOAD_S", "0"))

    def load(settings, preloaded=None) -> FakeEncoder:
        time.sleep(load_s)
        return encoder

    # every load goes through it: service.load_encoder's, and `embedsvc serve`'s loading thread
    backend.load_encoder = load  # type: ignore[assignment]
    return main()


if __name__ == "__main__":
    sys.exit(run())
