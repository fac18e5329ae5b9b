"""The import rules of docs/architecture.md, checked on the source: lower layers never import upper ones or Ray."""

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "ballast"

# package -> (ballast packages it may import, third-party roots it must not import)
RULES = {
    "protocol": ({"protocol"}, {"ray"}),
    "balance": ({"balance"}, {"ray", "transformers"}),
    "models": ({"models"}, {"ray"}),
    "data": ({"data", "models", "tools"}, {"ray"}),  # tools: the sandbox the code-execution reward runs in
    "engine": ({"engine", "balance"}, {"ray"}),
    "single_controller": ({"single_controller", "protocol"}, set()),
    "tools": ({"tools"}, {"ray", "torch", "transformers"}),
    "workers": ({"workers", "engine", "protocol", "single_controller", "models", "tools"}, set()),
}


def _imports(path: Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


@pytest.mark.parametrize("package", sorted(RULES))
def test_package_respects_the_layering(package):
    allowed, forbidden_roots = RULES[package]
    violations = []
    for path in sorted((PKG / package).rglob("*.py")):
        for name in _imports(path):
            parts = name.split(".")
            if parts[0] == "ballast" and len(parts) > 1 and parts[1] not in allowed:
                violations.append(f"{path.relative_to(PKG.parent)} imports {name}")
            if parts[0] in forbidden_roots:
                violations.append(f"{path.relative_to(PKG.parent)} imports {name}")
    assert not violations, "\n".join(violations)


def test_the_config_package_imports_no_other_part_of_the_trainer():
    # The run's plan (ballast.trainer.run.run_plan) builds on the config, never the other way round.
    violations = [f"{path.relative_to(PKG.parent)} imports {name}"
                  for path in sorted((PKG / "trainer" / "config").rglob("*.py")) for name in _imports(path)
                  if name == "ballast.trainer" or (name.startswith("ballast.trainer.")
                                                   and not name.startswith("ballast.trainer.config"))]
    assert not violations, "\n".join(violations)


def test_every_module_opens_with_a_docstring():
    missing = [str(p.relative_to(PKG.parent)) for p in sorted(PKG.rglob("*.py"))
               if p.read_text().strip() and ast.get_docstring(ast.parse(p.read_text())) is None]
    assert not missing, "modules without a docstring:\n" + "\n".join(missing)


def test_test_module_basenames_are_unique():
    # Test folders have no __init__.py, so pytest imports test modules by basename: two files with the
    # same name in different folders make collection fail.
    from collections import Counter

    tests = Path(__file__).resolve().parents[1]
    names = Counter(p.name for p in tests.rglob("*.py") if p.name != "conftest.py")
    assert not [n for n, c in names.items() if c > 1], [n for n, c in names.items() if c > 1]
