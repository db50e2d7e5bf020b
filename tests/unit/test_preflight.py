"""preflight.py: what `embedsvc serve` refuses before loading the model, and how."""

import socket

import pytest

from embedsvc.serving.preflight import (
    FAILURE,
    USAGE,
    PreflightError,
    check_device,
    check_listen,
    check_model,
)


def test_a_local_model_path_must_be_a_directory(tmp_path):
    check_model("")  # the bundled model
    check_model(str(tmp_path))
    check_model("sentence-transformers/all-MiniLM-L6-v2")  # a hub id: checked when it loads
    (tmp_path / "model.bin").write_bytes(b"")
    for path, why in ((tmp_path / "model.bin", "a file, not a model directory"),
                      (tmp_path / "missing", "no such directory"),
                      ("./missing-model", "no such directory")):
        with pytest.raises(PreflightError, match=why) as info:
            check_model(str(path))
        assert info.value.exit_code == USAGE
        assert "setting MODEL (env EMBEDSVC_MODEL, flag --model)" in str(info.value)


def test_a_port_in_use_is_a_failure_that_names_the_fix():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(PreflightError, match="the port is in use") as info:
            check_listen("127.0.0.1", port)
    assert info.value.exit_code == FAILURE and "--port or EMBEDSVC_PORT" in str(info.value)
    check_listen("127.0.0.1", 0)


def test_a_host_that_is_not_here_is_refused():
    with pytest.raises(PreflightError, match="not an address of this machine") as info:
        check_listen("192.0.2.1", 0)  # TEST-NET-1: never a local address
    assert info.value.exit_code == FAILURE
    with pytest.raises(PreflightError, match="setting HOST") as info:
        check_listen("no-such-host.invalid", 0)
    assert info.value.exit_code == USAGE


def test_a_device_that_is_not_here_is_a_failure():
    check_device("cpu")
    check_device("auto")
    with pytest.raises(PreflightError, match="DEVICE is 'cuda:99' but torch sees") as info:
        check_device("cuda:99")
    assert info.value.exit_code == FAILURE
