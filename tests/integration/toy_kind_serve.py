"""`embedsvc serve` on the fake encoder (fake_serve.py) with a kind of work that only tests
have, added as any new kind is: one ``Kind`` subclass and one line in ``WORK_KINDS``, and here
a route to reach it. The engine process and the fronts of ``--workers N`` are this program
again, so every process of the service knows the kind.

    python -m tests.integration.toy_kind_serve serve --port 0 [--workers 2]
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import orjson

from embedsvc import work_kinds
from embedsvc.api import routes
from embedsvc.api.web import Call, Reply, Route, embedded_reply
from embedsvc.work import Embedded, Work

from .fake_serve import run

TOY = "lengths"


class Lengths(work_kinds.Kind):
    """Each input's token count (special tokens in) beside the first component of its raw
    row, both from the model side, which holds the ids and the rows."""

    name = TOY

    def finish(self, encoder: Any, work: Work, rows: np.ndarray) -> Embedded:
        counts = np.array([len(ids) for ids in work.ids], np.float32)
        return Embedded(np.stack([counts, rows[:, 0]], axis=1).astype(np.float32), 0)


def lengths(call: Call) -> Reply:
    """POST /toy/lengths {"texts": [...]}: the toy kind's rows."""
    texts = orjson.loads(call.body)["texts"]
    out = call.run(call.work(TOY, texts))
    return embedded_reply({"rows": out.vectors.tolist()}, out, len(texts))


def register() -> None:
    """Add the kind and its route (in this process only: never at import, which the test
    run's doctest collection does)."""
    work_kinds.WORK_KINDS[TOY] = Lengths()  # the kind's one line
    # before the app is built: the pipeline takes the table it is given
    routes.ROUTES = (*routes.ROUTES,
                     Route("/toy/lengths", "POST", lengths, "a test's kind of work"))


if __name__ == "__main__":
    register()
    sys.exit(run())
