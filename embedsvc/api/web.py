"""What the request pipeline and the route handlers exchange: ``Route``, ``Call``, ``Reply``.

A handler takes a ``Call`` (the raw body and what the pipeline learned about the request)
and returns a ``Reply``; it never sees the web framework.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson
from pydantic import BaseModel

from ..errors import OPENAI, ErrorShape, InvalidRequest
from ..work import Embedded, ModelInfo, Work
from .lane import BodyLane

if TYPE_CHECKING:
    from ..engine_client import EngineClient
    from ..service import Service

JSON = "application/json"


@dataclass(slots=True)
class Reply:
    """A response: status, body, extra headers, and what the access log reports."""

    status: int
    body: bytes
    headers: list[tuple[str, str]] = field(default_factory=list)
    content_type: str = JSON
    inputs: int = 0
    tokens: int = 0


def json_reply(body: Any, status: int = 200, headers: list[tuple[str, str]] | None = None
               ) -> Reply:
    return Reply(status, orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY), headers or [])


@dataclass(slots=True)
class Call:
    """One request as a handler sees it."""

    service: Service
    body: bytes
    arrived: float
    disconnected: Callable[[], bool] | None = None
    flow: Hashable | None = None  # the client's connection: its turn among others' (batcher)
    params: dict[str, str] = field(default_factory=dict)  # the path's, by the route's {names}
    lane: BodyLane | None = None  # large bodies' turns (lane.py); None: parsed at once
    tenant: str | None = None  # whose API key it presented (tenants.py)
    kinds: frozenset[str] | None = None  # the model kinds its route serves (Route.kinds)
    path: str = ""  # its route's path
    chosen: Service | None = None  # the model's service it went to, with several models
    model: str | None = None  # the model its body names (bodies.parse), with several models
    _client: EngineClient | None = None

    @property
    def deadline(self) -> float:
        return self.arrived + self.service.settings.request_timeout_s

    def work(self, kind: str, inputs: Any, **options: Any) -> Work:
        """The one value a handler builds: what to compute (``Work``'s fields as
        ``options``), with what the pipeline knows of this request (deadline, client,
        connection)."""
        # tenants take turns for the device, and their clients within each one's turns
        return Work(kind, inputs, deadline=self.deadline, disconnected=self.disconnected,
                    flow=self.tenant or self.flow, tenant=self.tenant, **options)

    def run(self, work: Work) -> Embedded:
        """``work``'s answer from the engine (its rows, in input order). A refusal of its
        inputs names the route's field (``work.param``: 'inputs', 'texts', 'prompt'), where
        the rules name them all 'input', as OpenAI's route calls them."""
        try:
            return (self._client or self.engine_client()).run(work)
        except InvalidRequest as exc:
            if work.param != "input" and exc.param == "input":
                exc.param = work.param
                if exc.message.startswith("'input'"):
                    exc.message = f"'{work.param}'" + exc.message[len("'input'"):]
            raise

    @property
    def info(self) -> ModelInfo:
        """The served model (waits for it as ``engine_client`` does)."""
        return (self._client or self.engine_client()).info

    def engine_client(self) -> EngineClient:
        """The handle on the engine, waiting for the model up to this request's deadline (else
        503)."""
        if self._client is None:
            timeout = max(0.0, self.deadline - time.monotonic())
            if not self.service.others:
                self._client = self.service.ready(timeout)
            else:  # several models: the one the body names, or the route's kind's first
                chosen = self.chosen = self.service.choose(self.model, self.kinds, timeout)
                self._client = chosen.ready(max(0.0, self.deadline - time.monotonic()))
                check_kind(self.kinds, self._client.info.kind, self.path, chosen.name)
        return self._client


def check_kind(kinds: frozenset[str] | None, kind: str, path: str, name: str = "") -> None:
    """400 ``wrong_model_kind`` for a model of ``kind`` (named ``name``, with several) on a
    route of ``kinds``."""
    if kinds is not None and kind not in kinds:
        wanted = " or ".join(sorted(kinds))
        served = f"model {name!r} is {_a(kind)} model" if name else \
            f"this server serves {_a(kind)} model"
        raise InvalidRequest(f"{path} needs {_a(wanted)} model, but {served}; see /info and "
                             "/openapi.json for its routes", code="wrong_model_kind")


def _a(word: str) -> str:
    return ("an " if word[:1] in "aeiou" else "a ") + word


Handler = Callable[[Call], Reply]


@dataclass(frozen=True, slots=True)
class Route:
    """One row of the route table.

    ``open`` routes need no API key; ``kinds`` (when set) are the model kinds the route
    serves, and any other kind gets a 400 that names the kind being served. Unlisted routes
    (the /docs page's script and style files) are left out of /openapi.json. ``errors`` is
    the error shape of the route's API family (errors.py): the pipeline writes every error
    of the route in it, whichever step refused the request. A path may end in one
    parameter, ``/v1/models/{model}``: it takes the rest of the path, slashes too (a model
    id such as ``org/name``), and the handler finds it in ``Call.params``.
    """

    path: str
    method: str
    handler: Handler
    summary: str
    request: type[BaseModel] | None = None  # the body's pydantic model, for /openapi.json
    response: dict[str, Any] | None = None  # the JSON schema of a 200 body
    open: bool = False
    kinds: frozenset[str] | None = None
    listed: bool = True
    errors: ErrorShape = OPENAI

    @property
    def parameter(self) -> str | None:
        """The name of the parameter the path ends in, if it does."""
        stem, brace, name = self.path.rpartition("/{")
        return name.removesuffix("}") if brace and name.endswith("}") else None


def embedded_reply(body: Any, out: Embedded, inputs: int) -> Reply:
    reply = json_reply(body, headers=[
        ("x-queue-time", f"{out.queue_s * 1000:.3f}"),
        ("x-tokenization-time", f"{out.tokenize_s * 1000:.3f}"),
        ("x-inference-time", f"{out.inference_s * 1000:.3f}"),
        ("x-total-time", f"{out.total_s * 1000:.3f}"),
        ("x-compute-tokens", str(out.tokens)),
    ])
    reply.inputs = inputs
    reply.tokens = out.tokens
    return reply

