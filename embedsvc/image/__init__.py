"""Images for image-text models (issue 48): safe decoding in the HTTP fronts (``decode``) and
preprocessing without torch (``preprocess``), so that the engine receives float32 pixel arrays.

Neither module loads weights nor imports ``model/``: the fronts run them, so ``--workers N``
spreads the decoding. Pillow comes with the ``image`` extra; ``require_pillow`` names it.
Not wired yet: the routes will call ``decode.decode_image`` on each image item and
``preprocess.Preprocessor.from_dir(record)`` on the result, and hand the array to the engine
as the payload of an image Work (issue 46 gives that work its owner class).
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
