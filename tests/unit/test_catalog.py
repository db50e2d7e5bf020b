"""The models one service serves (catalog.py): MODELS and MODELS_FILE, each refusal one line."""

from __future__ import annotations

import pytest

from embedsvc.catalog import PINNED, catalog, pinned
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
    """tests/unit/test_memory.py weighs each kind of model and device; here, what
    `embedsvc serve` makes of a refusal."""
    from embedsvc.serving.preflight import PreflightError, check_memory

    models = []
    for name, size in (("a", 3 << 40), ("b", 2 << 40)):  # sparse: no disk used
        (tmp_path / name).mkdir()
        with open(tmp_path / name / "pytorch_model.bin", "wb") as f:
            f.truncate(size)
        models.append((name, Settings(model=str(tmp_path / name), device="cpu")))
    refused = r"take 5242880 MiB \(a 3145728 MiB float32, b 2097152 MiB float32\), more than"
    with pytest.raises(PreflightError, match=refused) as caught:
        check_memory(models)
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


def test_a_run_reads_its_models_file_as_it_found_it(tmp_path):
    """MODELS_FILE is copied into the run's private directory by the first process: one
    started after the file was edited (an engine's replacement, a new worker) serves the
    list the run started with, so an engine's index names the same model everywhere."""
    listed = tmp_path / "models.toml"
    listed.write_text('[[models]]\nname = "a"\nsource = ""\n\n'
                      '[[models]]\nname = "b"\nsource = ""\n')
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    first = pinned(Settings(models_file=str(listed)), run)
    assert first.models_file == str(run / PINNED)
    assert oct((run / PINNED).stat().st_mode & 0o777) == "0o600"
    listed.write_text('[[models]]\nname = "c"\nsource = ""\n')  # edited while it runs
    later = pinned(Settings(models_file=str(listed)), run)
    assert [e.name for e in catalog(later)] == ["a", "b"]
    assert sorted(p.name for p in run.iterdir()) == [PINNED]  # no copy left behind
    assert pinned(Settings(models="x="), run).models_file is None  # MODELS: nothing to copy
    missing = Settings(models_file=str(tmp_path / "gone.toml"))
    assert pinned(missing, tmp_path / "elsewhere") == missing  # catalog() says why


def test_a_models_own_queue_bound_derives_its_own_inputs_per_request(tmp_path):
    """MAX_INPUTS_PER_REQUEST, unset, is derived from MAX_QUEUE (at most 2048): a model's own
    max_queue of 100 kept the base's 2048 and stopped the start, blaming a setting the user
    never set. One set explicitly above the model's bound still says so."""
    path = tmp_path / "models.toml"
    path.write_text('[[models]]\nname = "a"\nsource = "/m/a"\n[models.settings]\n'
                    'max_queue = 100\n\n[[models]]\nname = "b"\nsource = "/m/b"\n')
    first, second = catalog(Settings(models_file=str(path)))
    assert (first.settings.max_queue, first.settings.max_inputs_per_request) == (100, 100)
    assert second.settings.max_inputs_per_request == 2048
    with pytest.raises(SettingsError, match="MAX_INPUTS_PER_REQUEST"):
        catalog(Settings(models_file=str(path), max_inputs_per_request=500))
