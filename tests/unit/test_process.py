import os
import subprocess
import sys
import time
import types

import pytest

from embedsvc.model.fake import FakeEncoder
from embedsvc.serving import process
from embedsvc.serving.process import (
    BAD_FORK_MESSAGE,
    LazyApp,
    check_fork,
    preloading_in_gunicorn_master,
    sibling_workers,
    warn_if_wasteful,
)
from embedsvc.settings import Settings

from ..waiting import soon


def fake_torch(bad_fork: bool | None):
    cuda = types.SimpleNamespace()
    if bad_fork is not None:
        cuda._is_in_bad_fork = lambda: bad_fork
    return types.SimpleNamespace(cuda=cuda)


def test_import_and_app_touch_no_cuda():
    code = """
import sys, torch
calls = []
for name in ("is_available", "device_count", "_lazy_init", "init", "current_device"):
    setattr(torch.cuda, name, lambda *a, _n=name: calls.append(_n))
import embedsvc
app = embedsvc.app
assert calls == [], calls
assert not torch.cuda.is_initialized()
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_import_and_app_load_nothing_heavy():
    code = """
import sys, embedsvc
embedsvc.app
print(sorted(m for m in ("torch", "sentence_transformers", "transformers") if m in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr


def test_bad_fork_is_one_line_naming_cause_and_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", fake_torch(bad_fork=True))
    with pytest.raises(RuntimeError) as info:
        check_fork(Settings())
    message = str(info.value)
    assert message == BAD_FORK_MESSAGE and "\n" not in message
    assert "CUDA was initialised in the parent" in message
    assert "--preload" in message and "post_fork" in message
    with pytest.raises(RuntimeError):
        LazyApp(env={})  # a worker loading the app fails at boot, not at its first request
    check_fork(Settings(device="cpu"))  # a CPU worker does not need CUDA


def test_bad_fork_check_tolerates_a_torch_without_the_flag(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", fake_torch(bad_fork=None))
    check_fork(Settings())
    monkeypatch.setitem(sys.modules, "torch", fake_torch(bad_fork=False))
    check_fork(Settings())


def test_a_poisoned_child_exits_at_boot_with_gunicorns_boot_error(monkeypatch, capsys):
    app = LazyApp(env={})
    monkeypatch.setitem(sys.modules, "torch", fake_torch(bad_fork=True))

    def exit_(code):
        raise SystemExit(code)

    monkeypatch.setattr(process.os, "_exit", exit_)
    with pytest.raises(SystemExit) as info:
        app._after_fork_in_child()
    assert info.value.code == process.WORKER_BOOT_ERROR == 3
    assert capsys.readouterr().err.strip() == BAD_FORK_MESSAGE


def test_preload_is_recognised_only_inside_gunicorns_arbiter_setup(monkeypatch):
    class Arbiter:
        def setup(self):
            return preloading_in_gunicorn_master()

    module = types.ModuleType("gunicorn.arbiter")
    module.Arbiter = Arbiter
    monkeypatch.setitem(sys.modules, "gunicorn.arbiter", module)
    assert Arbiter().setup() is True
    assert preloading_in_gunicorn_master() is False


def test_several_workers_on_a_gpu_get_a_warning():
    assert sibling_workers(123, read=lambda path: "11 12 13\n") == 3
    assert sibling_workers(123, read=lambda path: (_ for _ in ()).throw(OSError())) == 1
    message = warn_if_wasteful("cuda:0", 3, "gunicorn")
    assert message and "3 gunicorn workers" in message and "-w 1 --threads N" in message
    assert warn_if_wasteful("cpu", 3, "gunicorn") is None
    assert warn_if_wasteful("cuda", 1, "gunicorn") is None


def test_a_forked_child_builds_its_own_service():
    app = LazyApp(env={"EMBEDSVC_DEVICE": "cpu"}, load=lambda settings, pre: FakeEncoder())
    parent = app.service
    assert app.warm(timeout=5) is parent
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child reports what it sees, then leaves without pytest's teardown
        try:
            child = app.warm(timeout=5)
            resp = app.flask().test_client().post("/embed", json={"inputs": "x"})
            ok = child is not parent and child.pid == os.getpid() and child.state == "ready"
            os.write(write, f"{ok} {resp.status_code}".encode())
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    assert os.read(read, 100).decode() == "True 200"
    assert app.service is parent and parent.ready().port.state == "ready"
    parent.drain(timeout=1)


def test_the_open_files_limit_is_raised_to_fit_the_connections():
    import resource

    from embedsvc.serving.process import ensure_open_files

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
        opened = ensure_open_files(500, per_connection=2, spare=100)
        want = opened.held + 100 + 500 * 2
        assert opened.limit == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if hard == resource.RLIM_INFINITY or hard >= want:
            assert (opened.limit, opened.connections) == (want, 500)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_connections_are_bounded_by_what_a_low_hard_limit_holds(monkeypatch, caplog):
    import resource

    from embedsvc.serving.process import ensure_open_files

    monkeypatch.setattr(resource, "getrlimit", lambda which: (300, 400))
    monkeypatch.setattr(resource, "setrlimit", lambda which, limits: None)
    opened = ensure_open_files(1000, per_connection=5, spare=100)
    assert opened.limit == 400
    assert opened.connections == (400 - opened.held - 100) // 5
    assert f"up to {opened.connections} connections: open-files limit 400" in str(opened)
    assert "raise the limit (ulimit -n, LimitNOFILE=) or lower MAX_CONNECTIONS" in caplog.text


def test_the_supervisor_backs_off_children_that_never_came_up_and_not_those_that_did():
    import shutil

    from embedsvc.serving.supervisor import Child, Supervisor

    supervisor = Supervisor(Settings(port=0, workers=2))
    try:
        def exited(up: bool) -> Child:
            proc = subprocess.Popen([sys.executable, "-c", ""])
            proc.wait()
            if up:
                (supervisor.directory / f"up-{proc.pid}").touch()
            return Child("engine", proc)

        waits = []
        for _ in range(4):
            child = exited(up=False)
            assert supervisor._judge(child, 1)
            assert child.restart_at is not None
            waits.append(child.restart_at - time.monotonic())
        assert [round(w * 2) / 2 for w in waits] == [0.5, 1.0, 2.0, 4.0]
        for _ in range(10):  # killed once it served: replaced at once, the count reset
            child = exited(up=True)
            assert supervisor._judge(child, -9)
            assert child.restart_at is not None and child.restart_at <= time.monotonic()
        assert all(supervisor._judge(exited(up=False), 1) for _ in range(4))
        assert not supervisor._judge(exited(up=False), 1)  # the fifth in a row: stop
    finally:
        supervisor._close_listeners()
        shutil.rmtree(supervisor.directory, ignore_errors=True)


def _dying_engines(engine, monkeypatch, reaped: bool = True):
    """``engine``'s starts, each an engine killed 0.2 s after its start, after it marked
    itself up where the test says (``up``, before each start): a list of their processes.
    ``reaped``: the worker that started each one lives to reap it (else it went first)."""
    from embedsvc.serving import shared_engine

    real = subprocess.Popen
    procs: list[subprocess.Popen] = []
    up = [False]

    def popen(cmd, **kwargs):
        mark = f"(pathlib.Path({str(engine.directory)!r}) / f'up-{{os.getpid()}}').touch()\n" \
            if up[0] else ""
        proc = real([sys.executable, "-c", "import os, pathlib, signal, time\n" + mark +
                     "time.sleep(0.2)\nos.kill(os.getpid(), signal.SIGKILL)"], **kwargs)
        procs.append(proc)
        return proc

    monkeypatch.setattr(shared_engine.subprocess, "Popen", popen)
    if not reaped:
        monkeypatch.setattr(engine, "_reap", lambda proc: None)
    return procs, up


def _lives(engine, procs, up, came_up: bool, reaped: bool) -> None:
    """One engine's life: started by a keeper, then gone."""
    count = len(procs)
    up[0] = came_up
    assert engine.ensure() is None
    assert len(procs) == count + 1, "no engine started"
    procs[-1].wait(10)
    if reaped:  # its worker's reaper says how it ended before the next keeper looks
        assert soon(lambda: (engine.directory / f"engine.exit-{procs[-1].pid}").exists())
    lock = os.open(engine.directory / "engine.alive", os.O_RDWR)
    try:  # its life lock free: as the next keeper finds it
        assert soon(lambda: _lockable(lock))
    finally:
        os.close(lock)


def _lockable(fd: int) -> bool:
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    fcntl.flock(fd, fcntl.LOCK_UN)
    return True


@pytest.mark.parametrize("reaped", [True, False], ids=["reaped", "its-worker-gone"])
def test_a_shared_engine_that_never_comes_up_is_not_started_for_ever(
        tmp_path, monkeypatch, reaped):
    """Under gunicorn, the workers' keepers start an engine whenever none runs. One that
    exited before it came up other than by failing to load its model (killed as it loaded,
    a native library's crash) wrote no failure, so a new one started every few seconds,
    each loading the model, for ever. After ``FAILED_STARTS`` in a row the failure is
    written and none starts again, as `embedsvc serve --workers` stops; an engine that
    came up starts the count anew. Counted by the next start, whichever worker makes it:
    counted by the worker that started each one, an engine whose worker had gone (recycled
    by ``max_requests``) was never counted, neither its failure nor its having come up."""
    import shutil
    import signal

    from embedsvc.serving import shared_engine
    from embedsvc.serving.lifeline import BOOT_FAILURE, FAILED_STARTS

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    # this process as the master: giving up leaves it running (waitress-serve's case)
    engine = shared_engine.SharedEngine(Settings(), os.getpid())
    procs, up = _dying_engines(engine, monkeypatch, reaped)
    try:
        for _ in range(FAILED_STARTS - 1):
            _lives(engine, procs, up, False, reaped)
        _lives(engine, procs, up, True, reaped)  # one that came up: the count starts anew
        for _ in range(FAILED_STARTS):
            _lives(engine, procs, up, False, reaped)
            assert not (engine.directory / BOOT_FAILURE).exists()
        count = len(procs)
        why = engine.ensure()  # the last one counted: none starts again
        assert why is not None and len(procs) == count, why
        assert f"exited before it came up {FAILED_STARTS} times in a row" in why
        assert (f"signal {signal.SIGKILL}" if reaped else "exit status unseen") in why, why
        assert not list(engine.directory.glob("engine.exit-*"))  # each read once, then gone
        assert engine.ensure() is not None and len(procs) == count
    finally:
        for proc in procs:
            proc.wait(10)
        shutil.rmtree(engine.root, ignore_errors=True)


def test_a_front_started_after_the_supervisors_signal_is_handed_an_open_listener(
        monkeypatch):
    """`embedsvc serve --workers N` closed its copies of the listening sockets in its
    signal handler: a front started after it (the rest of the fronts at start, a
    replacement) was handed a closed socket's -1, Popen raised, and the supervisor exited
    with a traceback, leaving the fronts it had started undrained. They now close as the
    watch ends, after the last start."""
    import shutil
    import signal

    from embedsvc.serving import supervisor

    started: list[dict] = []
    monkeypatch.setattr(supervisor.subprocess, "Popen", lambda cmd, **kwargs: started.append(
        kwargs) or types.SimpleNamespace(pid=4242, poll=lambda: None))
    sup = supervisor.Supervisor(Settings(port=0, workers=1))
    try:
        sup._on_signal(signal.SIGTERM, None)
        sup._start("front", sup.listeners[0])
        assert started and min(started[0]["pass_fds"]) >= 0, started
    finally:
        sup._close_listeners()
        shutil.rmtree(sup.directory, ignore_errors=True)


def test_a_shared_engine_is_started_once_while_it_lives_whatever_the_pid_files_say(
        tmp_path, monkeypatch):
    """Under gunicorn, whether the shared engine runs was read from a pid file written after
    its start: a worker killed in between left it unlisted, and the next worker started a
    second engine (a second copy of the model). The engine now holds a lock for its whole
    life, taken by the worker that starts it and inherited with its descriptor: while it
    lives no worker starts another, and once it is gone the next look starts one."""
    import shutil
    import signal

    from embedsvc.serving import shared_engine

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    engine = shared_engine.SharedEngine(Settings(), os.getpid())
    started: list[subprocess.Popen] = []
    popen = subprocess.Popen

    def a_stand_in(cmd, **kwargs):  # an engine that only lives, with what it inherits
        assert kwargs.get("pass_fds"), kwargs
        proc = popen([sys.executable, "-c", "import time; time.sleep(60)"],
                     pass_fds=kwargs["pass_fds"], start_new_session=True)
        started.append(proc)
        return proc

    monkeypatch.setattr(shared_engine.subprocess, "Popen", a_stand_in)
    monkeypatch.setattr(engine, "_reap", lambda proc: proc.wait())
    try:
        engine._start()
        for leftover in engine.directory.glob("engine.pid"):
            leftover.unlink()  # as a worker that died before it wrote one leaves it
        engine._start()
        engine._start()
        assert len(started) == 1  # it runs: none other
        started[0].send_signal(signal.SIGKILL)
        started[0].wait(5)
        engine._start()
        assert len(started) == 2  # gone: the next look starts one
    finally:
        for proc in started:
            proc.kill()
            proc.wait(5)
        shutil.rmtree(engine.root, ignore_errors=True)


def test_an_engine_that_cannot_be_run_stops_gunicorn_with_the_reason(tmp_path, monkeypatch):
    """An interpreter gone from under a running gunicorn (its venv replaced by a deploy):
    the start's FileNotFoundError read as another worker having given up, so each worker
    stood down quietly, was replaced, and did the same, for ever."""
    import shutil

    from embedsvc.serving import shared_engine

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.setattr(shared_engine.sys, "executable", str(tmp_path / "gone" / "python"))
    engine = shared_engine.SharedEngine(Settings(), os.getpid())  # this process the master
    try:
        why = engine.ensure()
        assert why is not None and "gone/python could not be run" in why, why
    finally:
        shutil.rmtree(engine.root, ignore_errors=True)


def test_the_fronts_share_one_socket_where_the_platform_does_not_spread_a_group(monkeypatch):
    """macOS and the BSDs take SO_REUSEPORT but give one socket of the group every
    connection: there a socket per front left all but one front idle."""
    from embedsvc.serving import supervisor

    monkeypatch.setattr(supervisor, "_SPREADS", False)
    socks = supervisor._listeners("127.0.0.1", 0, 3)
    try:
        assert len(socks) == 1
    finally:
        for sock in socks:
            sock.close()


def test_an_engine_start_that_fails_for_now_is_tried_again_not_given_up(tmp_path, monkeypatch):
    """A start that fails for a passing reason (EAGAIN: the container's process limit, for
    a moment; ENOMEM) is not the engine's failure: written as one, it stopped gunicorn with
    the wrong cause, and left waitress-serve unhealthy after forks worked again."""
    import errno
    import shutil

    from embedsvc.serving import shared_engine
    from embedsvc.serving.lifeline import BOOT_FAILURE

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    engine = shared_engine.SharedEngine(Settings(), os.getpid())  # this process the master
    procs, up = _dying_engines(engine, monkeypatch)
    started = shared_engine.subprocess.Popen
    tries = []

    def out_of_processes(cmd, **kwargs):
        tries.append(cmd)
        if len(tries) == 1:
            raise BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")
        return started(cmd, **kwargs)

    monkeypatch.setattr(shared_engine.subprocess, "Popen", out_of_processes)
    try:
        assert engine.ensure() is None and not procs
        assert not (engine.directory / BOOT_FAILURE).exists()
        assert engine.ensure() is None and len(procs) == 1  # the next look starts it
    finally:
        for proc in procs:
            proc.wait(10)
        shutil.rmtree(engine.root, ignore_errors=True)


def test_a_watched_process_of_another_user_is_alive(monkeypatch):
    """gunicorn --user: the master runs as root, its workers and their engine as the user,
    and signal 0 to the master is refused (EPERM) while it runs. Without a pidfd to watch
    (an older kernel, macOS), that refusal must not read as the master gone: the engine
    would drain as soon as it loaded."""
    from embedsvc.serving import lifeline

    def refused(pid, signum):
        raise PermissionError(1, "Operation not permitted")

    def gone(pid, signum):
        raise ProcessLookupError(3, "No such process")

    monkeypatch.setattr(lifeline.os, "kill", refused)
    assert lifeline.alive(4242)
    monkeypatch.setattr(lifeline.os, "kill", gone)
    assert not lifeline.alive(4242)
