import argparse
import dataclasses
import re

import pytest

from embedsvc.cli import build_parser
from embedsvc.settings import Settings, SettingsError


def test_defaults_follow_the_contract():
    s = Settings()
    assert (s.device, s.dtype, s.max_batch_tokens, s.max_batch_size) == ("auto", "auto", 16384, 256)
    assert (s.max_wait_ms, s.max_queue, s.request_timeout_s) == (0.0, None, 30.0)
    assert s.max_queue_tokens == 1 << 20
    assert (s.max_inputs_per_request, s.max_body_bytes, s.auto_truncate) == (2048, 16 << 20, True)
    assert (s.api_key, s.host, s.port, s.threads) == (None, "127.0.0.1", 8080, 16)


def test_environment_keyword_and_flag_share_one_name():
    env = {"EMBEDSVC_MAX_BATCH_SIZE": "64", "EMBEDSVC_AUTO_TRUNCATE": "false",
           "EMBEDSVC_DEVICE": "CUDA:1", "EMBEDSVC_API_KEY": "k"}
    s = Settings.from_env(env, port=9000)
    assert (s.max_batch_size, s.auto_truncate, s.device, s.api_key, s.port) == (
        64, False, "cuda:1", "k", 9000)
    args = build_parser().parse_args(["serve", "--max-batch-size", "32", "--port", "0"])
    s = Settings.from_args(args, env)
    assert (s.max_batch_size, s.port, s.auto_truncate) == (32, 0, False)


def test_every_setting_has_a_flag():
    parser = argparse.ArgumentParser()
    Settings.add_arguments(parser)
    flags = {a.dest for a in parser._actions if a.dest != "help"}
    assert flags == set(Settings.__dataclass_fields__)


@pytest.mark.parametrize(
    ("env", "words"),
    [
        ({"EMBEDSVC_DEVICE": "gpu"}, ["DEVICE", "EMBEDSVC_DEVICE", "--device", "cuda:N"]),
        ({"EMBEDSVC_DTYPE": "int8"}, ["DTYPE", "float16"]),
        ({"EMBEDSVC_MAX_QUEUE": "0"}, ["MAX_QUEUE", "greater than 0"]),
        ({"EMBEDSVC_MAX_QUEUE": "lots"}, ["MAX_QUEUE", "lots"]),
        ({"EMBEDSVC_AUTO_TRUNCATE": "maybe"}, ["AUTO_TRUNCATE", "true"]),
        ({"EMBEDSVC_PORT": "70000"}, ["PORT", "0 to 65535"]),
        ({"EMBEDSVC_MAX_QUEUE": "100", "EMBEDSVC_MAX_INPUTS_PER_REQUEST": "200"},
         ["MAX_INPUTS_PER_REQUEST", "MAX_QUEUE", "--max-queue", "--max-inputs-per-request"]),
    ],
)
def test_bad_values_name_the_setting_and_the_fix(env, words):
    with pytest.raises(SettingsError) as info:
        Settings.from_env(env)
    for word in words:
        assert word in str(info.value)


def test_keyword_values_are_checked_like_strings():
    with pytest.raises(SettingsError, match="MAX_BATCH_TOKENS"):
        Settings(max_batch_tokens=-1)
    assert Settings(max_batch_size="8").max_batch_size == 8


def test_the_request_limit_follows_a_lowered_queue_unless_both_are_set():
    assert Settings.from_env({"EMBEDSVC_MAX_QUEUE": "64"}).max_inputs_per_request == 64
    assert Settings().max_inputs_per_request == 2048
    assert Settings(max_queue=4096).max_inputs_per_request == 2048
    with pytest.raises(SettingsError, match="MAX_INPUTS_PER_REQUEST"):
        Settings(max_queue=64, max_inputs_per_request=128)


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"EMBEDSVC_PORT": "eighty"}, "cannot be 'eighty': expected a whole number"),
        ({"EMBEDSVC_MAX_BATCH_SIZE": "2.5"}, "cannot be '2.5': expected a whole number"),
        ({"EMBEDSVC_REQUEST_TIMEOUT_S": "soon"}, "cannot be 'soon': expected a number"),
        ({"EMBEDSVC_REQUEST_TIMEOUT_S": "nan"}, "cannot be 'nan': expected a finite number"),
        ({"EMBEDSVC_MAX_WAIT_MS": "inf"}, "cannot be 'inf': expected a finite number"),
    ],
)
def test_numbers_are_refused_in_words_not_python_errors(env, says):
    with pytest.raises(SettingsError, match=re.escape(says)):
        Settings.from_env(env)


def test_a_misspelt_variable_is_named_with_the_setting_it_is_close_to(caplog):
    env = {"EMBEDSVC_MAX_CONECTIONS": "5", "EMBEDSVC_NOTHING_LIKE_IT": "1"}
    Settings.from_env(env)
    Settings.from_env(env)  # said once per process
    assert caplog.messages == [
        "EMBEDSVC_MAX_CONECTIONS is not a setting, so it is ignored; did you mean "
        "EMBEDSVC_MAX_CONNECTIONS?",
        "EMBEDSVC_NOTHING_LIKE_IT is not a setting, so it is ignored; the settings are in "
        "docs/settings.md",
    ]


NUMBERS = [f for f in dataclasses.fields(Settings)
           if f.type in ("int", "float", "int | None", "float | None")]


@pytest.mark.parametrize("field", NUMBERS, ids=[f.name for f in NUMBERS])
def test_every_number_has_an_upper_bound_checked_at_start(field):
    """A duration of 1e10 s or a size of 1e13 passes no setting (MAX_WAIT_MS=1e13 killed the
    batcher thread, DRAIN_TIMEOUT_S=1e10 never ended a drain)."""
    with pytest.raises(SettingsError, match="cannot be '10000000000000': must be"):
        Settings.from_env({f"EMBEDSVC_{field.name.upper()}": "10000000000000"})


def test_a_wait_for_a_fuller_batch_stays_below_the_request_deadline():
    assert Settings(max_wait_ms=20, request_timeout_s=1).max_wait_ms == 20
    with pytest.raises(SettingsError, match="lower EMBEDSVC_MAX_WAIT_MS"):
        Settings(max_wait_ms=1000, request_timeout_s=1)


@pytest.mark.parametrize("key", ["s3cret\n", "s3 cret", " ", "sécret", "s3cret\t"])
def test_an_api_key_clients_cannot_send_is_refused_without_repeating_it(key):
    with pytest.raises(SettingsError, match="printable ASCII without spaces") as info:
        Settings.from_env({"EMBEDSVC_API_KEY": key})
    assert repr(key) not in str(info.value) and "the value given" in str(info.value)


def test_an_api_key_of_printable_ascii_is_taken():
    assert Settings(api_key="sk-A1_b2.C3~!").api_key == "sk-A1_b2.C3~!"
    assert Settings.from_env({"EMBEDSVC_API_KEY": ""}).api_key is None


def test_several_workers_with_a_model_in_each_is_refused_with_the_fix():
    with pytest.raises(SettingsError, match="EMBEDSVC_ENGINE=auto"):
        Settings(workers=2, engine="inline")
    assert Settings(workers=2, engine="process").workers == 2
