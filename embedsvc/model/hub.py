"""A MODEL that names a model hub repository: found in the hub's cache, or fetchable now.

Where neither holds (no network, ``HF_HUB_OFFLINE``, a name that is not on the hub), the
start fails at once with one line, instead of retrying every config file the loaders ask for
(huggingface_hub retries each download for about 24 s when the hub does not answer).

>>> local_path("")  # the bundled model is no hub repository
"""

from __future__ import annotations

import os
from pathlib import Path

from .encoder import bundled

_TIMEOUT_S = 5.0  # one request to the hub's API; no retries


class ModelUnavailable(RuntimeError):
    """MODEL cannot be loaded here; the message says how to make it loadable."""


def repository(setting: str) -> str | None:
    """The hub repository that MODEL names, or None for the bundled model or a local path."""
    if bundled(setting) or os.path.isdir(setting):
        return None
    if os.path.isabs(setting) or setting.startswith((".", "~")):
        return None  # a path that is not there: preflight.check_model says so
    return setting


def local_path(setting: str) -> Path | None:
    """The hub cache's snapshot of the repository MODEL names, found without the network."""
    repo = repository(setting)
    if repo is None:
        return None
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo, local_files_only=True))
    except Exception:  # noqa: BLE001 - not in the hub cache (or not a valid repository id)
        return None


def check_fetchable(setting: str) -> None:
    """ModelUnavailable unless the repository MODEL names is in the hub cache or the hub
    answers for it now (the loaders then fetch its files)."""
    repo = repository(setting)
    if repo is None or local_path(setting) is not None:
        return
    from huggingface_hub import constants, model_info
    from huggingface_hub.errors import HFValidationError, RepositoryNotFoundError

    offline = (f"set EMBEDSVC_MODEL to a model directory, or fetch {repo} once where there "
               f"is network (`hf download {repo}`) and copy the hub cache "
               f"({constants.HF_HUB_CACHE}) here")
    if constants.HF_HUB_OFFLINE:
        raise ModelUnavailable(f"MODEL {repo!r} is not in the hub cache and HF_HUB_OFFLINE is "
                               f"set: {offline}")
    try:
        model_info(repo, timeout=_TIMEOUT_S)
    except (RepositoryNotFoundError, HFValidationError):
        raise ModelUnavailable(f"MODEL {repo!r} is not a model on {constants.ENDPOINT} (or a "
                               "private one: set HF_TOKEN), nor a local directory: check MODEL"
                               ) from None
    except Exception as exc:  # noqa: BLE001 - any failure to reach the hub: the same advice
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise ModelUnavailable(f"MODEL {repo!r} is not in the hub cache, and the model hub "
                               f"({constants.ENDPOINT}) does not answer ({reason}): offline, "
                               f"{offline}") from None
