"""What `embedsvc serve` and `embedsvc:app` build before their first answer, in a fresh
interpreter: the work of what is off or not yet asked for waits for its first use
(docs/architecture.md, "The start").

The server is built as ``serving/server.py``'s ``serve`` builds it (its port bound on
loopback, nothing served over it), and ``embedsvc:app`` as waitress-serve and gunicorn load
it, around the fake encoder; their app is called directly.
"""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]

CALL = """
import io, json, sys


def call(app, method, path, body=b""):
    got = []
    environ = {"REQUEST_METHOD": method, "PATH_INFO": path, "QUERY_STRING": "",
               "CONTENT_LENGTH": str(len(body)), "wsgi.input": io.BytesIO(body),
               "SERVER_NAME": "127.0.0.1", "SERVER_PORT": "80", "wsgi.url_scheme": "http",
               "SERVER_PROTOCOL": "HTTP/1.1"}
    out = b"".join(app(environ, lambda status, headers, exc=None: got.append(status)))
    return int(got[0].split()[0]), out.decode()
"""

SERVE = CALL + """
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


def built():
    return sorted(name for name in dir(schemas) if isinstance(getattr(schemas, name), type)
                  and issubclass(getattr(schemas, name), schemas.Request)
                  and getattr(schemas, name).__pydantic_complete__)


first = call(server.app, "POST", "/embed", b'{"inputs": "a first request"}')
modules = sorted(sys.modules)
schemas_built = built()
later = {"/v1/embeddings": call(server.app, "POST", "/v1/embeddings", b'{"input": "a"}'),
         "/nothing": call(server.app, "GET", "/nothing"),
         "/api/nothing": call(server.app, "GET", "/api/nothing")}
print(json.dumps({"first": first, "modules": modules, "built": schemas_built,
                  "later": later, "later_modules": sorted(sys.modules),
                  "built_later": built()}))
"""


LAZY = CALL + """
from embedsvc.model.fake import FakeEncoder
from embedsvc.serving.process import LazyApp

app = LazyApp({}, load=lambda settings, preloaded: FakeEncoder(dimension=4))
app.warm(timeout=30)
before = set(sys.modules)
first = call(app, "POST", "/embed", b'{"inputs": "a first request"}')
modules = sorted(sys.modules)
first_imported = sorted(set(sys.modules) - before)
flask = app.flask()  # a user's route on it is served by the app
flask.add_url_rule("/mine", "mine", lambda: "my own route")
later = {"/mine": call(app, "GET", "/mine"), "/nothing": call(app, "GET", "/nothing"),
         "test client": flask.test_client().post("/embed", json={"inputs": "x"}).status_code}
print(json.dumps({"first": first, "modules": modules, "later": later,
                  "first_imported": first_imported}))
"""
WEB_FRAMEWORK = {"flask", "werkzeug", "jinja2", "click", "itsdangerous"}

# `embedsvc serve` as serving/start.py runs it, the model's load replaced by one that waits
# (up to 10 s) for the web stack, and the server's run by the first request
OVERLAP = CALL + """
import threading, time
from embedsvc.model import backend
from embedsvc.model.fake import FakeEncoder
from embedsvc.serving import start
from embedsvc.settings import Settings

WEB = ("embedsvc.api.wsgi", "waitress", "pydantic.plugin._loader")
seen = {}


def load(settings, preloaded=None):
    if settings.model == "broken":
        raise OSError("no such model")
    seen["in_main_thread"] = threading.current_thread() is threading.main_thread()
    seen["web_at_start"] = [m for m in WEB if m in sys.modules]
    deadline = time.monotonic() + 10
    while not all(m in sys.modules for m in WEB) and time.monotonic() < deadline:
        time.sleep(0.005)
    seen["web_while_loading"] = [m for m in WEB if m in sys.modules]
    return FakeEncoder(dimension=4)


def first_request(settings, service):
    from embedsvc.serving.server import Server

    server = Server(settings, service)
    before = set(sys.modules)
    seen["first"] = call(server.app, "POST", "/embed", b'{"inputs": "a first request"}')
    seen["first_imported"] = sorted(set(sys.modules) - before)
    return 0


backend.load_encoder = load
start._run = first_request
seen["code"] = start.serve(Settings(port=0, host="127.0.0.1", model=sys.argv[1]))
print(json.dumps(seen))
"""


def _start(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout
    return json.loads(out.splitlines()[-1])


def test_the_first_answer_of_embedsvc_serve_needs_no_flask_and_one_schema():
    """Flask, Werkzeug and Jinja2 serve only paths outside the route table, and a route's
    request model is built by its first request: the first /embed needs neither."""
    start = _start(SERVE)
    status, body = start["first"]
    assert status == 200 and len(json.loads(body)[0]) == 4
    assert not WEB_FRAMEWORK & {m.split(".")[0] for m in start["modules"]}
    assert start["built"] == ["EmbedRequest"]

    # later requests get what they got before: another route's body, Flask's 404s in the
    # error shape of the path's API family
    later = start["later"]
    status, body = later["/v1/embeddings"]
    assert status == 200 and len(json.loads(body)["data"][0]["embedding"]) == 4
    assert "TypedEmbeddingsRequest" in start["built_later"]
    status, body = later["/nothing"]
    error = json.loads(body)["error"]
    assert status == 404 and error["code"] == "not_found"
    assert error["message"] == "no route /nothing; see /openapi.json"
    status, body = later["/api/nothing"]
    assert status == 404
    assert json.loads(body) == {"error": "no route /api/nothing; see /openapi.json"}
    assert "flask" in start["later_modules"]


def test_the_first_answer_of_embedsvc_app_needs_no_flask_and_its_flask_serves_alike():
    """``embedsvc:app`` (waitress-serve, gunicorn) serves the same pipeline: no web framework
    before its first answer; ``app.flask()`` builds the Flask app, whose routes the app
    serves and whose test client reaches embedsvc's routes."""
    start = _start(LAZY)
    status, body = start["first"]
    assert status == 200 and len(json.loads(body)[0]) == 4
    assert not WEB_FRAMEWORK & {m.split(".")[0] for m in start["modules"]}
    # pydantic looked up its plugins while the model loaded, not in the first request
    assert not [m for m in start["first_imported"] if m.startswith("pydantic")]
    later = start["later"]
    assert later["/mine"] == [200, "my own route"]
    status, body = later["/nothing"]
    assert status == 404 and json.loads(body)["error"]["code"] == "not_found"
    assert later["test client"] == 200


def test_embedsvc_serve_imports_the_web_stack_while_the_model_loads():
    """The model loads in a thread of its own from the start; meanwhile the main thread
    imports the pipeline, waitress and pydantic and has pydantic look up its plugins (which
    reads every installed distribution's metadata), so that neither waits for the other and
    the first request does not do that lookup."""
    out = subprocess.run([sys.executable, "-c", OVERLAP, "all-MiniLM-L6-v2"],
                         capture_output=True, text=True, check=True, cwd=ROOT).stdout
    seen = json.loads(out.splitlines()[-1])
    assert seen["code"] == 0 and seen["in_main_thread"] is False
    assert "pydantic.plugin._loader" not in seen["web_at_start"]
    assert seen["web_while_loading"] == ["embedsvc.api.wsgi", "waitress",
                                         "pydantic.plugin._loader"]
    status, body = seen["first"]
    assert status == 200 and len(json.loads(body)[0]) == 4
    assert not [m for m in seen["first_imported"] if m.startswith("pydantic")]


def test_a_model_that_fails_to_load_in_its_thread_is_one_line_and_exit_code_1():
    done = subprocess.run([sys.executable, "-c", OVERLAP, "broken"], capture_output=True,
                          text=True, cwd=ROOT)
    assert json.loads(done.stdout.splitlines()[-1]) == {"code": 1}
    errors = [line for line in done.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "the model failed to load: OSError: no such model" in errors[0]
    assert "Traceback" not in done.stderr
