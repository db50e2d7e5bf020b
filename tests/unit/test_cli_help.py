"""Each subcommand's --help offers its own flags only, each described for that subcommand."""

import re

import pytest

from embedsvc.cli import main
from embedsvc.settings import Settings

SERVER = {"--host", "--port", "--threads", "--drain-timeout-s", "--max-body-bytes",
          "--request-timeout-s", "--header-timeout-s", "--body-timeout-s", "--idle-timeout-s",
          "--send-timeout-s",
          "--otlp-endpoint",
          "--max-connections", "--health-port", "--token-ids", "--workers", "--engine",
          "--keys-file", "--image-url-hosts", "--models", "--models-file"}
ENGINE = {"--model", "--device", "--dtype", "--max-batch-tokens", "--max-batch-size",
          "--max-wait-ms", "--max-queue", "--max-inputs-per-request", "--max-input-chars",
          "--auto-truncate", "--backend", "--quantize", "--quantize-min-recall", "--cache-dir",
          "--onnx-threads", "--max-queue-tokens", "--kind", "--max-images-per-request",
          "--max-image-bytes", "--max-image-pixels"}
LOGS = {"--log-level", "--log-format"}
JOB = {"--output", "--text-field", "--id-field", "--image-field", "--url", "--chunk-size",
       "--concurrency", "--part-size", "--part-seconds", "--restart", "--ray", "--actors",
       "--actor-cpus", "--output-dtype"}
EXPORT = {"--model", "--backend", "--quantize", "--quantize-min-recall", "--cache-dir",
          "--onnx-threads"}
FLAGS = {
    "serve": SERVER | ENGINE | LOGS | {"--api-key"},
    "embed": JOB | ENGINE | LOGS | {"--api-key"},
    "export": EXPORT | LOGS,
}
_OPTION = re.compile(r"^  (?:-\w, )?(--[a-z][\w-]*)", re.MULTILINE)


def help_text(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def described(text):
    """The descriptions alone: flag and variable names say "request" in their own right, and
    a default is no description (MAX_IMAGE_PIXELS's, 40000000, holds a "400")."""
    return re.sub(r"\[env\s[^\]]*\]|--[\w-]+|EMBEDSVC_\w+|[A-Z][A-Z_]{2,}", "", text)


@pytest.mark.parametrize("command", sorted(FLAGS))
def test_each_subcommand_offers_its_own_flags_only(command, capsys):
    offered = set(_OPTION.findall(help_text(command, capsys))) - {"--help"}
    assert offered == FLAGS[command]


def test_every_setting_is_offered_by_some_subcommand():
    flags = {"--" + name.replace("_", "-") for name in Settings.__dataclass_fields__}
    assert flags == set().union(*FLAGS.values()) - JOB


@pytest.mark.parametrize("command", ["embed", "export"])
def test_no_description_speaks_of_the_http_server(command, capsys):
    text = " ".join(described(help_text(command, capsys)).split())
    for server_word in ("request", "400", "embedsvc serve", "is required", "HTTP"):
        assert server_word not in text, f"{command} --help says {server_word!r}"


def test_the_api_key_is_the_servers_for_serve_and_sent_to_url_for_embed(capsys):
    serve = " ".join(help_text("serve", capsys).split())
    embed = " ".join(help_text("embed", capsys).split())
    assert "--api-key API_KEY when set, 'Authorization: Bearer <key>' is required" in serve
    assert ("--api-key API_KEY with --url: the server's key, sent as 'Authorization: Bearer "
            "<key>'") in embed


def test_embed_help_names_the_commit_by_rows_or_time(capsys):
    text = " ".join(help_text("embed", capsys).split())
    assert "commit a part of the output after this many rows... (default: 10000)" in text
    assert "...or this many seconds after it was opened, whichever comes first" in text
    assert "(default: 30.0)" in text
