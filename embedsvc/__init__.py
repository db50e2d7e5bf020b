"""embedsvc: a self-hosted text-embedding service.

``embedsvc:app`` is the WSGI app for waitress-serve and gunicorn; importing this package loads
no model and touches no accelerator (see ``embedsvc.serving.process``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["__version__", "app", "create_app"]

if TYPE_CHECKING:
    from .api.wsgi import create_app
    from .serving.process import LazyApp

    app: LazyApp

_app = None


def __getattr__(name: str) -> Any:
    # Resolved on first use, so that `import embedsvc` stays cheap and reads no environment.
    global _app
    if name == "app":
        if _app is None:
            from .serving.process import LazyApp

            _app = LazyApp()
        return _app
    if name == "create_app":
        from .api.wsgi import create_app

        return create_app
    raise AttributeError(f"module 'embedsvc' has no attribute {name!r}")
