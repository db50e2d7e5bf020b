"""Images for image-text models (issue 48): safe decoding in the HTTP fronts (``decode``) and
preprocessing without torch (``preprocess``), so that the engine receives float32 pixel arrays.

Neither module loads weights nor imports ``model/``: the fronts run them, so ``--workers N``
spreads the decoding. Pillow comes with the ``image`` extra; ``require_pillow`` names it.
The ``Images`` kind of work (work_kinds.py) calls them through ``EngineClient.images`` on
each image a request sends, and the engine receives the float32 arrays as ``Pixels``.
"""

from __future__ import annotations

from types import ModuleType

MISSING = "images need Pillow: pip install 'embedsvc[image]'"


def require_pillow() -> ModuleType:
    """The PIL package, or an ImportError whose one line names the extra to install."""
    try:
        import PIL.Image
    except ImportError as exc:
        raise ImportError(MISSING) from exc
    return PIL
