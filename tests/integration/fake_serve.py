"""`embedsvc serve` as a process on the fake encoder, for tests of the server, not the model:

    python -m tests.integration.fake_serve serve --port 0 ...

Everything is the real command (settings, waitress, probes, signals, drain, exit codes, the
engine process and fronts of ``--workers N``, which are this program again) except the
encoder: a ``FakeEncoder`` at 384 dimensions that spends ``FAKE_SERVE_DELAY_S`` per batch
and ``FAKE_SERVE_PER_TOKEN_S`` per padded token in ``time.sleep`` (the GIL released, as during
device work), so that a test can catch a batch computing. Starting it costs a fraction of a
second of CPU, not a model load.
"""

from __future__ import annotations

import os
import sys

from embedsvc.cli import main
from embedsvc.model import backend
from embedsvc.model.fake import FakeEncoder


def run() -> int:
    """``embedsvc`` with this process's arguments, its model the fake encoder."""
    encoder = FakeEncoder(dimension=384, max_input_tokens=256, record=False,
                          delay_s=float(os.environ.get("FAKE_SERVE_DELAY_S", "0")),
                          per_token_s=float(os.environ.get("FAKE_SERVE_PER_TOKEN_S", "0")))
    # every load goes through it: service.load_encoder's, and `embedsvc serve`'s loading thread
    backend.load_encoder = lambda settings, preloaded=None: encoder  # type: ignore[assignment]
    return main()


if __name__ == "__main__":
    sys.exit(run())
