"""The package's imports go one way (the design's layer rule): ``_compat`` (torch's and
Triton's private names) imports nothing of fusepass, ``kernels`` nothing above it but
``_compat``, ``ops`` only those, ``passes`` only ``ops``, ``kernels`` and ``_compat``; the
backend (with its Inductor choices), explain and the integrations sit above them, the demo and the command line on top;
and no module takes part in an import cycle, counting imports inside functions."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "fusepass"
# (module-name prefix, layer): a module may import its own layer and those below
LAYERS = [("fusepass._compat", -1), ("fusepass.kernels", 0), ("fusepass.ops", 1), ("fusepass.passes", 2),
          ("fusepass.backend", 3), ("fusepass.choices", 3), ("fusepass.explain", 3), ("fusepass.integrations", 3),
          ("fusepass.distributed", 3), ("fusepass.demo", 4), ("fusepass.cli", 5), ("fusepass.__main__", 5),
          ("fusepass", 5)]


def _name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> int:
    return next(layer for prefix, layer in LAYERS if module == prefix or module.startswith(prefix + "."))


def _modules() -> dict[str, Path]:
    return {_name(p): p for p in PKG.rglob("*.py")}


def _imports(module: str, path: Path, known) -> set[str]:
    """The fusepass modules ``module`` imports (anywhere in the file), by name."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            # "from .x import y": y may be a module of package x
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        out |= {n for n in names if n == "fusepass" or n.startswith("fusepass.")}
    return {n for n in out if n in known} - {module}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    known = _modules()
    return {m: _imports(m, p, known) for m, p in known.items()}


def test_imports_follow_the_layers(graph):
    wrong = sorted(f"{m} (layer {_layer(m)}) imports {i} (layer {_layer(i)})"
                   for m, deps in graph.items() for i in deps if _layer(i) > _layer(m))
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle(graph):
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for dep in sorted(graph[m]):
            if state.get(dep) == 1:
                cycle = stack[stack.index(dep):] + [dep]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_the_checker_sees_imports_inside_functions(tmp_path):
    source = tmp_path / "probe.py"
    source.write_text("def f():\n    from .backend import fusepass_backend\n    from .ops import checks\n")
    assert _imports("fusepass.probe", source, _modules()) == {"fusepass.backend", "fusepass.ops.checks"}
    assert _layer("fusepass.passes.join") == 2 and _layer("fusepass") == 5
