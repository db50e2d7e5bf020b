"""`embedsvc embed` as a process on the fake encoder, for tests of the job, not the model:

    python -m tests.integration.fake_embed embed INPUT -o OUTPUT ...

Everything is the real command (parser, checks, job, checkpoint, signals) except the
encoder, a ``FakeEncoder`` that spends ``FAKE_EMBED_DELAY_S`` per batch and appends the size
of each batch it computed to the file ``FAKE_EMBED_COUNT`` (when set), so that a test knows
how far the job got and how much a rerun computed. ``FAKE_EMBED_SLOW_COMMIT_S`` makes each
part's commit wait that long first: a window in which to send a second signal;
``FAKE_EMBED_SLOW_CLOSE_S`` makes closing the engine, after the output is in place, wait that
long: a window in which a signal lands as the job finishes.
"""

from __future__ import annotations

import functools
import os
import sys
import time

from embedsvc.bulk import checkpoint, embedders
from embedsvc.cli import main
from embedsvc.model.fake import FakeEncoder


class CountingEncoder(FakeEncoder):
    def encode(self, batch):
        rows = super().encode(batch)
        if os.environ.get("FAKE_EMBED_COUNT"):
            with open(os.environ["FAKE_EMBED_COUNT"], "a") as f:
                f.write(f"{len(batch)}\n")
        return rows


def slow(method, seconds):
    @functools.wraps(method)
    def wrapper(self):
        time.sleep(seconds)
        method(self)

    return wrapper


if __name__ == "__main__":
    encoder = CountingEncoder(delay_s=float(os.environ.get("FAKE_EMBED_DELAY_S", "0")),
                              record=False)
    embedders.Service = functools.partial(embedders.Service, encoder=encoder)
    if os.environ.get("FAKE_EMBED_SLOW_COMMIT_S"):
        checkpoint.Checkpoint.commit = slow(checkpoint.Checkpoint.commit,
                                            float(os.environ["FAKE_EMBED_SLOW_COMMIT_S"]))
    if os.environ.get("FAKE_EMBED_SLOW_CLOSE_S"):
        embedders.LocalEmbedder.close = slow(embedders.LocalEmbedder.close,
                                             float(os.environ["FAKE_EMBED_SLOW_CLOSE_S"]))
    sys.exit(main())
