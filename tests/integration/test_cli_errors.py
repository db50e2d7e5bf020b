"""A user's mistake on `embedsvc` (serve side and the command line in general) is one line
that names the fix, on stderr, with exit code 2 for usage errors and 1 for failures; never a
traceback. Each case runs the real command, as a user types it."""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from .servers import BIN

USAGE, FAILURE = 2, 1
CASES = [
    # (id, arguments, extra environment, exit code, what the one line must say)
    ("no-command", [], {}, USAGE, "the following arguments are required: COMMAND"),
    ("unknown-command", ["srve"], {}, USAGE, "invalid choice: 'srve'"),
    ("unknown-flag", ["serve", "--prot", "8081"], {}, USAGE,
     "unrecognized arguments: --prot 8081 (see 'embedsvc serve --help')"),
    ("stray-argument", ["serve", "now"], {}, USAGE, "unrecognized arguments: now"),
    ("port-not-a-number", ["serve", "--port", "http"], {}, USAGE,
     "argument --port: expected a whole number"),
    ("port-out-of-range", ["serve", "--port", "70000"], {}, USAGE,
     "argument --port: must be a TCP port, 0 to 65535"),
    ("timeout-nan", ["serve", "--request-timeout-s", "nan"], {}, USAGE,
     "argument --request-timeout-s: expected a finite number"),
    ("batch-size-zero", ["serve", "--max-batch-size", "0"], {}, USAGE,
     "argument --max-batch-size: must be greater than 0"),
    ("unknown-device-flag", ["serve", "--device", "tpu"], {}, USAGE,
     "argument --device: expected auto, cpu, cuda, cuda:N or mps"),
    ("unknown-dtype-flag", ["serve", "--dtype", "float8"], {}, USAGE, "argument --dtype: expected"),
    ("bad-env-log-level", ["serve"], {"EMBEDSVC_LOG_LEVEL": "loud"}, USAGE,
     "setting LOG_LEVEL (env EMBEDSVC_LOG_LEVEL, flag --log-level) cannot be 'loud'"),
    ("bad-env-bool", ["serve"], {"EMBEDSVC_AUTO_TRUNCATE": "maybe"}, USAGE,
     "setting AUTO_TRUNCATE (env EMBEDSVC_AUTO_TRUNCATE, flag --auto-truncate) cannot be"),
    ("bad-env-port", ["serve"], {"EMBEDSVC_PORT": "80 80"}, USAGE,
     "setting PORT (env EMBEDSVC_PORT, flag --port) cannot be '80 80': expected a whole number"),
    ("wait-past-any-deadline", ["serve"], {"EMBEDSVC_MAX_WAIT_MS": "1e13"}, USAGE,
     "setting MAX_WAIT_MS (env EMBEDSVC_MAX_WAIT_MS, flag --max-wait-ms) cannot be '1e13': "
     "must be at most 60000"),
    ("drain-without-end", ["serve", "--drain-timeout-s", "1e10"], {}, USAGE,
     "argument --drain-timeout-s: must be at most 3600"),
    ("api-key-with-a-newline", ["serve"], {"EMBEDSVC_API_KEY": "s3cret\n"}, USAGE,
     "cannot be the value given: must be printable ASCII without spaces"),
    ("request-larger-than-queue-flags",
     ["serve", "--max-queue", "10", "--max-inputs-per-request", "100"], {}, USAGE,
     "MAX_INPUTS_PER_REQUEST (100) is larger than MAX_QUEUE (10)"),
    ("request-larger-than-queue-env", ["serve"],
     {"EMBEDSVC_MAX_QUEUE": "10", "EMBEDSVC_MAX_INPUTS_PER_REQUEST": "100"}, USAGE,
     "raise EMBEDSVC_MAX_QUEUE / --max-queue"),
    ("model-path-missing", ["serve", "--model", "/no/such/model"], {}, USAGE,
     "setting MODEL (env EMBEDSVC_MODEL, flag --model) cannot be '/no/such/model': "
     "no such directory"),
    ("model-path-relative-missing", ["serve", "--model", "./models/mini"], {}, USAGE,
     "cannot be './models/mini': no such directory"),
    ("model-path-is-a-file", ["serve", "--model", "{file}"], {}, USAGE,
     "a file, not a model directory"),
    ("host-unresolvable", ["serve", "--host", "no-such-host.invalid"], {}, USAGE,
     "setting HOST (env EMBEDSVC_HOST, flag --host) cannot be 'no-such-host.invalid'"),
    ("host-not-here", ["serve", "--host", "192.0.2.1", "--port", "0"], {}, FAILURE,
     "cannot listen on 192.0.2.1:0: 192.0.2.1 is not an address of this machine"),
    ("port-in-use", ["serve", "--port", "{busy_port}"], {}, FAILURE,
     "the port is in use (another embedsvc, or `make serve`?); stop it or choose another "
     "port with --port or EMBEDSVC_PORT"),
    ("cuda-device-absent", ["serve", "--device", "cuda:99"], {}, FAILURE,
     "DEVICE is 'cuda:99' but torch sees"),
    ("mps-device-absent", ["serve", "--device", "mps", "--port", "0"], {}, FAILURE,
     "DEVICE is 'mps' but torch sees no Apple GPU here"),
    ("hub-model-offline", ["serve", "--model", "no-such-org/no-such-model", "--port", "0"],
     {"HF_HUB_OFFLINE": "1"}, FAILURE,
     "MODEL 'no-such-org/no-such-model' is not in the hub cache and HF_HUB_OFFLINE is set: set "
     "EMBEDSVC_MODEL to a model directory, or fetch no-such-org/no-such-model once where there "
     "is network (`hf download no-such-org/no-such-model`)"),
    # no network: refused at once, not after a minute of retries for each config file
    ("hub-unreachable", ["serve", "--model", "no-such-org/no-such-model", "--port", "0"],
     {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:{closed_port}"}, FAILURE,
     "MODEL 'no-such-org/no-such-model' is not in the hub cache, and the model hub "
     "(http://127.0.0.1:{closed_port}) does not answer"),
    ("kind-without-its-head", ["serve", "--kind", "reranker", "--port", "0"], {}, USAGE,
     "KIND=reranker needs a model with a classification head, but MODEL is an embedding "
     "model (the bundled model)"),
    ("directory-not-a-model", ["serve", "--model", "{directory}", "--port", "0"], {}, FAILURE,
     "the directory holds no config.json or modules.json, so it is not a saved model"),
]


def run_embedsvc(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("EMBEDSVC_")}
    return subprocess.run([str(BIN / "embedsvc"), *args], env={**clean, **env}, cwd=cwd,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Iterator[dict[str, subprocess.CompletedProcess]]:
    """Every case's run, started together: a few of them import torch or load a model."""
    where = tmp_path_factory.mktemp("cli-errors")
    (where / "not-a-model").mkdir()
    (where / "not-a-model" / "notes.txt").write_text("not a model\n")
    (where / "weights.bin").write_bytes(b"\0" * 16)
    with socket.socket() as busy, socket.socket() as closed:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        closed.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        values = {"file": str(where / "weights.bin"), "directory": str(where / "not-a-model"),
                  "busy_port": str(busy.getsockname()[1]),
                  "closed_port": str(closed.getsockname()[1])}
        with ThreadPoolExecutor(max_workers=4) as pool:
            runs = {case[0]: pool.submit(run_embedsvc, [a.format(**values) for a in case[1]],
                                         {k: v.format(**values) for k, v in case[2].items()},
                                         where) for case in CASES}
            yield {"values": values, **{name: run.result() for name, run in runs.items()}}


@pytest.mark.parametrize(("name", "code", "message"), [(c[0], c[3], c[4]) for c in CASES],
                         ids=[c[0] for c in CASES])
def test_a_user_error_is_one_line_and_an_exit_code(name, code, message, results):
    result, values = results[name], results["values"]
    message = message.format(**values)
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr + result.stdout, result.stderr
    assert result.returncode == code, result.stderr
    assert len(lines) == 1 and result.stdout == "", result.stderr + result.stdout
    assert message in lines[0], lines[0]
    assert lines[0].startswith("embedsvc: ") or " ERROR " in lines[0], lines[0]


def test_there_are_enough_cases():
    assert len({c[0] for c in CASES}) == len(CASES) >= 12


def test_a_misspelt_variable_is_named_once_with_its_setting(tmp_path):
    result = run_embedsvc(["serve"], {"EMBEDSVC_MAX_CONECTIONS": "5",
                                      "EMBEDSVC_LOG_LEVEL": "loud"}, tmp_path)
    lines = result.stderr.strip().splitlines()
    assert lines == [
        "EMBEDSVC_MAX_CONECTIONS is not a setting, so it is ignored; did you mean "
        "EMBEDSVC_MAX_CONNECTIONS?",
        "embedsvc: setting LOG_LEVEL (env EMBEDSVC_LOG_LEVEL, flag --log-level) cannot be "
        "'loud': expected one of debug, info, warning, error",
    ], result.stderr
