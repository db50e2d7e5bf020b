"""``tests.integration.fake_app:app``: embedsvc's WSGI app around the fake encoder, for
gunicorn processes whose tests need large answers fast rather than real vectors."""

from embedsvc.model.fake import FakeEncoder
from embedsvc.serving.process import LazyApp

app = LazyApp(load=lambda settings, preloaded: FakeEncoder(dimension=384, record=False))
