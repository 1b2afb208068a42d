"""The package's layers: every module imports only from its own package or the layers below it.

errors -> data -> core -> ops, models -> algorithms -> run -> the ``jaxfl`` namespace. Imports inside functions
count too (a deferred import is still a dependency).
"""
import ast
from pathlib import Path

import pytest


PACKAGE = Path(__file__).resolve().parents[1] / "jaxfl"
LAYER = {"errors": 0, "data": 1, "core": 2, "ops": 3, "models": 3, "algorithms": 4, "run": 5, "__init__": 6}


def unit(module: str) -> str:
    """The layer unit of a dotted module inside jaxfl: its first component ('core', 'ops', ...)."""
    return module.split(".")[0] if module else "__init__"


def imports(path: Path):
    """(importing unit, imported unit, line) for every import of a jaxfl module in ``path``."""
    rel = path.relative_to(PACKAGE).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    here = unit(".".join(parts))
    package = parts if path.name == "__init__.py" else parts[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.split(".")[0] == "jaxfl":
                target = node.module.partition(".")[2]
            else:
                continue
            names = [a.name for a in node.names]
            targets = [target] if target else names  # "from . import ops" names the unit itself
            for t in targets:
                yield here, unit(t), node.lineno
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "jaxfl":
                    yield here, unit(a.name.partition(".")[2]), node.lineno


MODULES = sorted(PACKAGE.rglob("*.py"))


def test_every_unit_has_a_layer():
    units = {unit(".".join(p for p in m.relative_to(PACKAGE).with_suffix("").parts if p != "__init__"))
             for m in MODULES}
    assert units <= set(LAYER), units - set(LAYER)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_upward_or_sideways_imports(path):
    for here, there, line in imports(path):
        ok = there == here or LAYER[there] < LAYER[here]
        assert ok, f"{path.relative_to(PACKAGE)}:{line}: {here} (layer {LAYER[here]}) imports {there} " \
                   f"(layer {LAYER[there]})"


def test_relative_imports_are_resolved_to_their_units():
    # core/step.py imports ``..data.clients`` and ``.aggregation``; run/runner.py imports ``..algorithms``
    assert {("core", "core"), ("core", "data")} <= {(h, t) for h, t, _ in imports(PACKAGE / "core" / "step.py")}
    assert ("run", "algorithms") in {(h, t) for h, t, _ in imports(PACKAGE / "run" / "runner.py")}
