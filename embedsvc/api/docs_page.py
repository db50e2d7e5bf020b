"""``GET /docs``: Swagger UI over ``/openapi.json``, for people.

Every file the page loads is served from here, out of the installed ``flask-swagger-ui``
package (Swagger UI 5, which renders OpenAPI 3.1: its release files alone, 2.5 MB where
``swagger-ui-py`` installs 25 MB), so the page works offline and fetches
nothing from another host: the online validator Swagger UI would otherwise call is off.
Links are relative, so the page also works behind a proxy that serves embedsvc under a prefix.
"""

from __future__ import annotations

import functools
from importlib import resources

from .web import Call, Handler, Reply

PAGE = b"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>embedsvc API</title>
<link rel="stylesheet" href="docs/swagger-ui.css">
<link rel="icon" type="image/png" href="docs/favicon-32x32.png">
</head>
<body>
<div id="swagger-ui"></div>
<script src="docs/swagger-ui-bundle.js"></script>
<script>
window.ui = SwaggerUIBundle({
  url: "openapi.json",
  dom_id: "#swagger-ui",
  deepLinking: true,
  validatorUrl: null,
  tryItOutEnabled: true,
  persistAuthorization: true
});
</script>
</body>
</html>
"""
# The files the page loads: path under /docs/ -> content type.
ASSETS = {
    "swagger-ui.css": "text/css; charset=utf-8",
    "swagger-ui-bundle.js": "text/javascript; charset=utf-8",
    "favicon-32x32.png": "image/png",
}
_CACHED = [("Cache-Control", "public, max-age=86400")]


def page(call: Call) -> Reply:
    """GET /docs: the page."""
    return Reply(200, PAGE, content_type="text/html; charset=utf-8")


def to_page(call: Call) -> Reply:
    """GET /docs/: the page's links are relative to /docs, so it is not served here but
    redirected there, by a relative reference that holds behind a proxy's prefix too."""
    return Reply(308, b"", [("Location", "../docs")], content_type="text/html; charset=utf-8")


def asset(name: str) -> Handler:
    """The handler of ``GET /docs/<name>``: the file, from the installed package."""

    def serve(call: Call) -> Reply:
        return Reply(200, _read(name), list(_CACHED), content_type=ASSETS[name])

    serve.__name__ = f"docs_{name}"
    return serve


@functools.cache
def _read(name: str) -> bytes:
    return resources.files("flask_swagger_ui").joinpath("dist", name).read_bytes()
