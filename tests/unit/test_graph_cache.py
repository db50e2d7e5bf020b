"""The cache of exported graphs: built once, rebuilt when unusable, safe to start twice at once."""

import errno
import multiprocessing
import tempfile
import time
from pathlib import Path

import pytest

from embedsvc.model.graph_cache import GraphCache, cache_root

GOOD = "graph v1"


def load(path: Path) -> str:
    text = path.read_text()
    if text != GOOD:
        raise ValueError(f"not a graph: {text[:20]!r}")
    return text


class Builder:
    def __init__(self, content: str = GOOD) -> None:
        self.content = content
        self.calls = 0

    def __call__(self, path: Path) -> None:
        self.calls += 1
        path.write_text(self.content)


def test_a_missing_file_is_built_once_then_read(tmp_path):
    cache, build = GraphCache(tmp_path / "c"), Builder()
    path = cache.path("all-MiniLM-L6-v2", "ab" * 32)
    assert cache.get_or_build(path, build, load) == (GOOD, path)
    assert cache.get_or_build(path, build, load) == (GOOD, path)
    assert build.calls == 1
    assert path.read_text() == GOOD
    # the lock file is hidden in .locks: nothing beside the graph but the graph
    assert sorted(p.name for p in path.parent.iterdir()) == [".locks", path.name]
    assert [p.name for p in (path.parent / ".locks").iterdir()] == [path.name + ".lock"]


@pytest.mark.parametrize("content", ["graph", "", "garbage\x00\x01"], ids=["truncated", "empty",
                                                                           "corrupt"])
def test_an_unusable_file_is_rebuilt_not_served(tmp_path, content):
    cache, build = GraphCache(tmp_path), Builder()
    path = cache.path("m", "cd" * 32)
    path.write_text(content)
    assert cache.get_or_build(path, build, load) == (GOOD, path)
    assert build.calls == 1 and path.read_text() == GOOD


def test_a_build_that_does_not_load_is_never_published(tmp_path):
    cache = GraphCache(tmp_path)
    path = cache.path("m", "ef" * 32)
    with pytest.raises(ValueError, match="not a graph"):
        cache.get_or_build(path, Builder("half a gra"), load)
    assert not path.exists()
    assert [p.name for p in tmp_path.iterdir()] == [".locks"]  # no temporary left


def _start(root: str, counter: str, out: str) -> None:
    def build(path: Path) -> None:
        with open(counter, "a") as f:
            f.write("built\n")
        with open(path, "w") as f:  # slowly, so that a reader could catch half a file
            for ch in GOOD:
                f.write(ch)
                f.flush()
                time.sleep(0.02)

    cache = GraphCache(Path(root))
    Path(out).write_text(cache.get_or_build(cache.path("m", "12" * 32), build, load)[0])


def test_what_a_build_that_never_finished_left_is_removed_by_the_next_build(tmp_path):
    """A process killed as it built a graph (an engine whose supervisor died as it loaded,
    a SIGKILL) left its temporary, a model-sized file, and nothing removed it: each such
    start left another. The next build of the same graph, under the lock every build
    holds, removes them; another graph's are not its to touch."""
    cache, build = GraphCache(tmp_path), Builder()
    path = cache.path("m", "ab" * 32)
    other = cache.path("m2", "cd" * 32)
    left = [path.with_name(f".{path.stem}.{pid}-0123abcd.tmp{path.suffix}") for pid in (7, 99)]
    theirs = other.with_name(f".{other.stem}.7-0123abcd.tmp{other.suffix}")
    for file in (*left, theirs):
        file.write_text("half a graph")
    assert cache.get_or_build(path, build, load) == (GOOD, path)
    assert not any(file.exists() for file in left) and theirs.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([".locks", path.name,
                                                                 theirs.name])


def test_processes_starting_together_build_once_and_all_read_the_whole_file(tmp_path):
    counter = tmp_path / "builds"
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_start, args=(str(tmp_path / "c"), str(counter),
                                              str(tmp_path / f"out{i}")))
             for i in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert [(tmp_path / f"out{i}").read_text() for i in range(4)] == [GOOD] * 4
    assert counter.read_text() == "built\n"


def test_the_cache_root_follows_the_setting_then_xdg_then_home(tmp_path):
    assert cache_root(str(tmp_path)) == tmp_path
    assert cache_root("", {"XDG_CACHE_HOME": "/x"}) == Path("/x/embedsvc")
    assert cache_root("", {}) == Path.home() / ".cache" / "embedsvc"


def test_names_stay_inside_the_cache_directory(tmp_path):
    path = GraphCache(tmp_path).path("../../etc/org/model", "ab" * 32)
    assert path.parent == tmp_path and path.name.endswith("-" + "ab" * 12 + ".onnx")


def test_a_cache_that_cannot_be_written_builds_privately_says_so_and_leaves_nothing(
        tmp_path, monkeypatch, caplog):
    def refuse(self, *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(self))

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # this test's $TMPDIR
    monkeypatch.setattr(Path, "mkdir", refuse)  # as a read-only mount answers; root ignores modes
    cache, build = GraphCache(tmp_path / "ro"), Builder()
    for start in (1, 2):  # every start builds it again, in memory
        text, where = cache.get_or_build(cache.path("m", "34" * 32), build, load)
        assert list(scratch.iterdir()) == [], "a start left its build in $TMPDIR"
        assert text == GOOD and where == cache.path("m", "34" * 32)
        assert build.calls == start
    monkeypatch.undo()
    assert not (tmp_path / "ro").exists()
    assert "cannot write the cache" in caplog.text and "embedsvc export" in caplog.text
