"""The package's layers, enforced: every import of embedsvc's own modules runs downward.

    api -> service -> remote -> {engine_client, runner} -> work_kinds
        -> {batching, model, rules} -> foundation

and the boundary between the HTTP side and the model: the API's modules build ``Work`` and
read ``Embedded`` (work.py) and import nothing of the model side (model/, batching/, runner,
remote/), so that an HTTP process in front of the engine process holds no model.

with serving/ and bulk/ above the api and the service, and the entry points (cli, the package
face, __main__, the gunicorn worker's published path) above everything. Imports made inside
functions and under TYPE_CHECKING count too: a lazy import upward is still an upward import.
"""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[2] / "embedsvc"

# (rank, group): a module may import its own group, or a group of lower rank.
LAYERS = {
    "settings": (0, "foundation"), "errors": (0, "foundation"),
    "metrics": (0, "foundation"), "logs": (0, "foundation"), "work": (0, "foundation"),
    "tenants": (0, "foundation"), "admission": (0, "foundation"), "catalog": (0, "foundation"),
    "tenant_usage": (0, "foundation"),
    "model": (1, "model"), "batching": (1, "batching"), "rules": (1, "rules"),
    "image": (1, "image"),
    "work_kinds": (2, "work_kinds"),
    "engine_client": (3, "engine_client"), "runner": (3, "runner"),
    "remote": (4, "remote"),
    "service": (5, "service"),
    "api": (6, "api"),
    "serving": (7, "serving"), "bulk": (7, "bulk"),
    "cli": (8, "entry"), "__main__": (8, "entry"), "gunicorn_worker": (8, "entry"),
}
MODEL_SIDE = ("model", "batching", "runner", "remote")
# The app factory wires a service (it takes an encoder for tests and library users).
BOUNDARY_EXEMPT = {"embedsvc.api.wsgi"}
# serving/'s modules on an HTTP process's path in front of the engine process, and in
# children.py every function but the engine's own entry
FRONT_PATH = ("server.py", "waitress_adapter.py", "http_errors.py", "drain.py", "lifeline.py",
              "children.py")
ENGINE_ENTRIES = {"run_engine"}
# What a front process may hold of model/: the tokenizer rebuilt from the engine's card
FRONT_MODEL = {"embedsvc.model", "embedsvc.model.text", "embedsvc.model.tokenizer",
               "embedsvc.model.window", "embedsvc.model.pairs"}
# What a front imports, as `embedsvc front` and its first connection to the engine do
FRONT_IMPORTS = ("embedsvc.cli", "embedsvc.serving.children", "embedsvc.serving.server",
                 "embedsvc.api.wsgi", "embedsvc.api.routes", "embedsvc.remote.client",
                 "embedsvc.model.text")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(dotted: str) -> bool:
    where = PACKAGE.parent.joinpath(*dotted.split("."))
    return where.with_suffix(".py").exists() or where.is_dir()


def imports(path: Path, skip: frozenset[str] = frozenset()
            ) -> list[tuple[int, str, list[str]]]:
    """(line, imported module, names) for every import of embedsvc's own code in ``path``,
    but those in the functions named in ``skip``."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    tree = ast.parse(path.read_text())
    skipped = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)
               and f.name in skip for n in ast.walk(f)}
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, []) for a in node.names
                      if a.name.split(".")[0] == "embedsvc"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            if target.split(".")[0] != "embedsvc":
                continue
            modules = [n for n in (a.name for a in node.names) if is_module(f"{target}.{n}")]
            found += [(node.lineno, f"{target}.{n}", []) for n in modules]
            names = [a.name for a in node.names if a.name not in modules]
            if names:
                found.append((node.lineno, target, names))
    return found


def layer(module: str) -> tuple[int, str] | None:
    parts = module.split(".")
    if len(parts) < 2:
        return None  # the package face
    return LAYERS[parts[1]]


def sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def violations() -> list[str]:
    found = []
    for path in sources():
        importer = module_name(path)
        if importer == "embedsvc":
            continue  # the package face hands out the entry points, lazily
        own = layer(importer)
        for line, target, names in imports(path):
            where = f"{path.relative_to(PACKAGE.parent)}:{line}"
            theirs = layer(target)
            if theirs is None:
                if set(names) - {"__version__"}:
                    found.append(f"{where} imports {names} from the package face; only "
                                 "__version__ may come from there")
                continue
            if theirs[1] == own[1]:
                continue
            if theirs[0] >= own[0]:
                found.append(f"{where}: {importer} ({own[1]}) imports {target} ({theirs[1]}), "
                             "which is not below it")
    return found


def test_every_module_has_a_layer():
    for path in sources():
        name = module_name(path)
        if name != "embedsvc":
            assert name.split(".")[1] in LAYERS, f"{name}: give it a layer in this test"


def test_no_import_runs_upward_or_sideways():
    assert violations() == []


def boundary_violations() -> list[str]:
    found = []
    front = [PACKAGE / "serving" / name for name in FRONT_PATH]
    for path in [*sorted((PACKAGE / "api").rglob("*.py")), *front]:
        importer = module_name(path)
        if importer in BOUNDARY_EXEMPT or not path.exists():
            continue
        on_front = path in front  # which reaches the engine through remote/'s link
        for line, target, _ in imports(path, frozenset(ENGINE_ENTRIES)):
            parts = target.split(".")
            if on_front and parts[1:2] == ["remote"] and target != "embedsvc.remote.server":
                continue
            if len(parts) > 1 and parts[1] in MODEL_SIDE:
                found.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}, "
                             "which is the model's side of the boundary (build a Work)")
    return found


def test_the_api_and_the_front_path_import_nothing_of_the_model_side():
    assert boundary_violations() == []


def test_a_front_process_imports_only_the_tokenizer_of_the_model_side():
    """The boundary for processes, not only for import lines: what `embedsvc front` imports
    (its entry, the HTTP server, the app and its routes, the link to the engine and the
    tokenizer it rebuilds from the engine's card), in a fresh interpreter. Of model/ only
    the tokenizer's modules; nothing of batching/, runner, the engine's server or bulk/;
    no ONNX Runtime, PyTorch or tokenizers' model code beyond the tokenizer."""
    code = ("import importlib, json, sys\n"
            f"for name in {FRONT_IMPORTS!r}:\n"
            "    importlib.import_module(name)\n"
            "print(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=PACKAGE.parent).stdout
    modules = set(json.loads(out))
    ours = {m for m in modules if m.startswith("embedsvc.")}
    model_side = {m for m in ours if m.split(".")[1] in (*MODEL_SIDE, "bulk", "image")}
    assert model_side - FRONT_MODEL == {"embedsvc.remote", "embedsvc.remote.client",
                                        "embedsvc.remote.place", "embedsvc.remote.stream",
                                        "embedsvc.remote.wake", "embedsvc.remote.wire"}
    assert not {"onnxruntime", "torch", "transformers", "sentence_transformers"} & modules


def test_the_boundary_check_sees_a_model_import(tmp_path, monkeypatch):
    fake = tmp_path / "embedsvc"
    (fake / "api").mkdir(parents=True)
    (fake / "model").mkdir()
    for name in ("__init__.py", "api/__init__.py", "model/__init__.py", "model/encoder.py"):
        (fake / name).write_text("")
    (fake / "api" / "tei.py").write_text("from ..model import encoder\n")
    monkeypatch.setitem(globals(), "PACKAGE", fake)
    assert boundary_violations() == [
        "embedsvc/api/tei.py:1 imports embedsvc.model.encoder, which is the model's side of "
        "the boundary (build a Work)"]


def test_no_import_circle():
    graph: dict[str, set[str]] = {}
    for path in sources():
        graph[module_name(path)] = {t for _, t, _ in imports(path)}
    # a module's import of its package's face runs that package's __init__ first
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in graph or nxt == "embedsvc":
                continue
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                pytest.fail("import circle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_the_check_sees_an_upward_import(tmp_path, monkeypatch):
    """The walk itself: an engine client module that imported the API would be reported."""
    fake = tmp_path / "embedsvc"
    (fake / "api").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "api" / "__init__.py").write_text("")
    (fake / "api" / "routes.py").write_text("")
    (fake / "engine_client.py").write_text("from .api import routes\nfrom . import rules\n")
    (fake / "rules.py").write_text("")
    monkeypatch.setitem(globals(), "PACKAGE", fake)
    assert [v.split(": ", 1)[1] for v in violations()] == [
        "embedsvc.engine_client (engine_client) imports embedsvc.api.routes (api), which is not "
        "below it"]
