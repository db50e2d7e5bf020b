"""The models one service serves (catalog.py): MODELS and MODELS_FILE, each refusal one line."""

from __future__ import annotations

import pytest

from embedsvc.catalog import catalog
from embedsvc.settings import Settings, SettingsError


def test_a_models_file_gives_each_model_its_own_settings(tmp_path):
    path = tmp_path / "models.toml"
    path.write_text('[[models]]\nname = "embedder"\nsource = "/m/bge"\n'
                    'aliases = ["text-embedding-3-small"]\n'
                    '[models.settings]\nmax_batch_tokens = 8192\nkind = "embedding"\n\n'
                    '[[models]]\nname = "reranker"\nsource = "/m/rr"\n')
    base = Settings(models_file=str(path), max_batch_tokens=4096, request_timeout_s=7)
    first, second = catalog(base)
    assert (first.name, first.aliases, first.settings.model) == (
        "embedder", ("text-embedding-3-small",), "/m/bge")
    assert (first.settings.max_batch_tokens, first.settings.kind) == (8192, "embedding")
    assert (second.settings.max_batch_tokens, second.settings.request_timeout_s) == (4096, 7)
    assert not second.settings.models_file  # each model's settings are a one-model service's


@pytest.mark.parametrize("models,found", [
    ("a=/m/a,a=/m/b", "a names two models"),
    ("/m/a", "is not NAME=SOURCE"),
    ("a b=/m/a", "a model's name must be"),
    (",", "MODELS lists no model"),
])
def test_a_list_that_cannot_be_served_is_refused(models, found):
    with pytest.raises(SettingsError, match=found) as caught:
        catalog(Settings(models=models))
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("table,found", [
    ('[models.settings]\nport = 9000', "'port' is not a model's own setting"),
    ('[models.settings]\nmax_batch_tokens = -1', "model m: "),
    ('colour = "red"', "unknown field 'colour'"),
])
def test_a_models_file_that_cannot_be_served_is_refused(tmp_path, table, found):
    path = tmp_path / "models.toml"
    path.write_text(f'[[models]]\nname = "m"\nsource = "/m"\n{table}\n')
    with pytest.raises(SettingsError, match=found):
        catalog(Settings(models_file=str(path)))


def test_models_whose_weights_do_not_fit_stop_the_start_in_one_line(tmp_path):
    from embedsvc.serving.preflight import PreflightError, check_memory

    for name, size in (("a", 3 << 20), ("b", 2 << 20)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"\0" * size)
    models = [("a", str(tmp_path / "a")), ("b", str(tmp_path / "b")), ("c", "org/not-here")]
    check_memory(models, available=6 << 20)
    with pytest.raises(PreflightError, match=r"take 5 MiB \(a 3 MiB, b 2 MiB, c 0 MiB\), "
                                             r"more than the 4 MiB") as caught:
        check_memory(models, available=4 << 20)
    assert caught.value.exit_code == 1 and "\n" not in str(caught.value)


@pytest.mark.parametrize("models,found", [
    ("a=/m/a,a:latest=/m/b", "a names two models"),
])
def test_names_that_ollamas_clients_cannot_tell_apart_are_refused(models, found):
    with pytest.raises(SettingsError, match=found):
        catalog(Settings(models=models))


@pytest.mark.parametrize("table,found", [
    ('settings = "abc"', "settings must be a table"),
    ('[models.settings]\nmodel = "/other"', "'model' is not a model's own setting"),
    ('aliases = ["b c"]', "aliases must be a list of names"),
])
def test_a_models_file_says_what_is_wrong_in_one_line(tmp_path, table, found):
    path = tmp_path / "models.toml"
    path.write_text(f'[[models]]\nname = "m"\nsource = "/m"\n{table}\n')
    with pytest.raises(SettingsError, match=found):
        catalog(Settings(models_file=str(path)))


def test_an_alias_equal_to_its_own_name_is_no_second_model(tmp_path):
    path = tmp_path / "models.toml"
    path.write_text('[[models]]\nname = "a"\nsource = "/m"\naliases = ["a", "a:latest"]\n')
    (entry,) = catalog(Settings(models_file=str(path)))
    assert entry.aliases == ("a", "a:latest")
