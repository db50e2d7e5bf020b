"""What `embedsvc serve` builds before its first answer, in a fresh interpreter: the work of
what is off or not yet asked for waits for its first use (docs/architecture.md, "The start").

The server is built as ``serving/server.py``'s ``serve`` builds it (its port bound on
loopback, nothing served over it), around the fake encoder, and its app is called directly.
"""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]

SERVE = """
import io, json, sys
import embedsvc.cli, embedsvc.serving.server  # what `embedsvc serve` imports
from embedsvc.api import schemas
from embedsvc.model.fake import FakeEncoder
from embedsvc.service import Service
from embedsvc.serving.server import Server
from embedsvc.settings import Settings

settings = Settings(port=0, host="127.0.0.1")
service = Service(settings, encoder=FakeEncoder(dimension=4))
service.start(background=False)
server = Server(settings, service)


def call(method, path, body=b""):
    got = []
    environ = {"REQUEST_METHOD": method, "PATH_INFO": path, "QUERY_STRING": "",
               "CONTENT_LENGTH": str(len(body)), "wsgi.input": io.BytesIO(body),
               "SERVER_NAME": "127.0.0.1", "SERVER_PORT": "80", "wsgi.url_scheme": "http",
               "SERVER_PROTOCOL": "HTTP/1.1"}
    out = b"".join(server.app(environ, lambda status, headers, exc=None: got.append(status)))
    return int(got[0].split()[0]), json.loads(out)


def built():
    return sorted(name for name in dir(schemas) if isinstance(getattr(schemas, name), type)
                  and issubclass(getattr(schemas, name), schemas.Request)
                  and getattr(schemas, name).__pydantic_complete__)


first = call("POST", "/embed", b'{"inputs": "a first request"}')
modules = sorted(sys.modules)
schemas_built = built()
later = {"/v1/embeddings": call("POST", "/v1/embeddings", b'{"input": "a"}'),
         "/nothing": call("GET", "/nothing"), "/api/nothing": call("GET", "/api/nothing")}
print(json.dumps({"first": first, "modules": modules, "built": schemas_built,
                  "later": later, "later_modules": sorted(sys.modules),
                  "built_later": built()}))
"""


def _serve_start() -> dict:
    out = subprocess.run([sys.executable, "-c", SERVE], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout
    return json.loads(out.splitlines()[-1])


def test_the_first_answer_of_embedsvc_serve_needs_no_flask_and_one_schema():
    """Flask, Werkzeug and Jinja2 serve only paths outside the route table, and a route's
    request model is built by its first request: the first /embed needs neither."""
    start = _serve_start()
    status, body = start["first"]
    assert status == 200 and len(body[0]) == 4
    tops = {m.split(".")[0] for m in start["modules"]}
    assert not {"flask", "werkzeug", "jinja2", "click", "itsdangerous"} & tops
    assert start["built"] == ["EmbedRequest"]

    # later requests get what they got before: another route's body, Flask's 404s in the
    # error shape of the path's API family
    later = start["later"]
    status, body = later["/v1/embeddings"]
    assert status == 200 and len(body["data"][0]["embedding"]) == 4
    assert "TypedEmbeddingsRequest" in start["built_later"]
    status, body = later["/nothing"]
    assert status == 404 and body["error"]["code"] == "not_found"
    assert body["error"]["message"] == "no route /nothing; see /openapi.json"
    status, body = later["/api/nothing"]
    assert status == 404 and body == {"error": "no route /api/nothing; see /openapi.json"}
    assert "flask" in start["later_modules"]
