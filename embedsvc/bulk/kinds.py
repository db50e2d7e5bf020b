"""Which model kinds ``embedsvc embed`` writes, and where: an embedding model's dense rows to
any output, a sparse model's (SPLADE) elements to JSONL only; rerankers and classifiers not
at all (they answer requests; they do not fill files); images only with an image-text model
(CLIP, SigLIP). The kind comes from the model's config files before it loads, or from a
server's GET /info.

>>> kind_problem("sparse", ".npy", "MODEL is").split(":")[-1]
' use an --output ending in .jsonl'
"""

from __future__ import annotations

from typing import Any

from ..model.kinds import KindMismatch, resolve
from ..settings import Settings
from .errors import UsageError
from .parts import JSONL

IMAGE_TEXT = "image-text"  # model/kinds.py's kind of CLIP and SigLIP
SPARSE_ON_RAY = ("MODEL is a sparse model: --ray writes dense vectors to Parquet shards; drop "
                 "--ray and use an --output ending in .jsonl")

def expected_kind(settings: Settings) -> str | None:
    """The kind the model will load as, from its config files (None: unreadable; the load
    then says what is wrong)."""
    try:
        return resolve(settings.kind, settings.model).kind
    except KindMismatch as exc:
        raise UsageError(str(exc)) from None
    except (OSError, ValueError, RuntimeError):  # a bad path or hub id, a broken config, a
        # hub that does not answer: the load reports it
        return None


def kind_problem(kind: str | None, output: str | None, serving: str = "MODEL is") -> str | None:
    """Why ``embedsvc embed`` cannot write ``output`` (a format of parts.py; None: any) with a
    model of ``kind``; None when it can."""
    if kind in ("reranker", "classifier"):
        return (f"{serving} a {kind} model: embedsvc embed writes embeddings; reranking and "
                "classification are request/response jobs (serve the model and POST /rerank "
                "or /predict)")
    if kind == "sparse" and output not in (None, JSONL):
        return (f"{serving} a sparse model, whose vectors are written as JSONL "
                '({"id", "sparse": [{"index", "value"}]} per line), not as '
                f"{output}: use an --output ending in .jsonl")
    return None


def image_problem(kind: str | None) -> str | None:
    """Why a model of ``kind`` cannot embed an image job's images (None: it can, or its kind
    is not known yet; the loaded model's modalities tell then)."""
    if kind is None or kind == IMAGE_TEXT:
        return None
    what = "a text embedding" if kind == "embedding" else f"a {kind}"
    return (f"MODEL is {what} model, which embeds no images: a folder of images or "
            "--image-field needs an image-text model (CLIP, SigLIP); name one with --model")


def dtype_problem(kind: str | None, dtype: str, images: bool = False) -> str | None:
    """Why rows of a model of ``kind`` (of images, with ``images``) cannot be written as
    ``dtype`` (--output-dtype)."""
    if dtype != "float" and images:  # the server's codes are calibrated on texts
        return (f"--output-dtype {dtype} quantizes texts' embeddings; images are written as "
                "float vectors, as the server answers them: drop --output-dtype")
    if dtype != "float" and kind == "sparse":
        return (f"--output-dtype {dtype} quantizes dense embeddings and MODEL is a sparse "
                "model: drop --output-dtype")
    return None


def _info(resp: Any) -> dict[str, Any]:
    """A GET /info answer's fields (none where it is not a JSON object: not an embedsvc)."""
    try:
        info = resp.json() if resp.status_code == 200 else {}
    except ValueError:
        return {}
    return info if isinstance(info, dict) else {}


def told_dimension(resp: Any) -> int | None:
    """The width of the rows a GET /info answer names (embedsvc's ``dimension``), if any."""
    value = _info(resp).get("dimension")
    return value if type(value) is int and value > 0 else None


def served_kind(resp: Any) -> str:
    """The kind a GET /info answer names: embedsvc's ``kind``, else TEI's ``model_type``
    (``{"reranker": ...}``, ``{"embedding": {"pooling": "splade"}}``); else embeddings."""
    info = _info(resp)
    if isinstance(info.get("kind"), str):
        return str(info["kind"])
    model_type = info.get("model_type")
    if isinstance(model_type, dict) and len(model_type) == 1:
        [(name, detail)] = model_type.items()
        if name == "embedding":
            splade = isinstance(detail, dict) and detail.get("pooling") == "splade"
            return "sparse" if splade else "embedding"
        return str(name)
    return "embedding"
