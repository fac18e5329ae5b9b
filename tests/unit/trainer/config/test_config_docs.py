"""Every config key is documented where its type is, and read by the code.

The schema's convention: each dataclass field is followed by a string literal that says what the key
means (an attribute docstring). A yaml key without one, or a field that nothing outside the schema and
the loader reads, fails here. Keys accepted only so that verl command lines work unchanged say so in
their docstring ("Accepted for verl compatibility") and are the only ones allowed to go unread.
"""

import ast
import dataclasses
import typing
from pathlib import Path

import pytest
import yaml

from ballast.trainer.config import BallastConfig
from ballast.trainer.config.loader import CONFIG_DIR

PKG = Path(__file__).resolve().parents[4] / "ballast"
SCHEMA_DIR = PKG / "trainer" / "config" / "schema"
UNREAD_OK = "Accepted for verl compatibility"


def _field_docs() -> dict:
    """{(class name, field name): docstring or None} for every dataclass in the schema modules."""
    docs = {}
    for path in sorted(SCHEMA_DIR.glob("*.py")):
        for cls in ast.parse(path.read_text()).body:
            if not isinstance(cls, ast.ClassDef):
                continue
            body = cls.body
            for i, stmt in enumerate(body):
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                    nxt = body[i + 1] if i + 1 < len(body) else None
                    doc = (nxt.value.value if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                           and isinstance(nxt.value.value, str) else None)
                    docs[(cls.name, stmt.target.id)] = doc
    return docs


def _schema_fields(cls=BallastConfig, prefix=""):
    """(dotted key, owning class, field name, is a section) for every field under `cls`."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        # an optional section (Optional[Section]) is a section too
        tp = next((a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)), tp)
        owner = next(c for c in cls.__mro__ if f.name in getattr(c, "__annotations__", {}))
        yield prefix + f.name, owner.__name__, f.name, dataclasses.is_dataclass(tp)
        if dataclasses.is_dataclass(tp):
            yield from _schema_fields(tp, f"{prefix}{f.name}.")


def _yaml_keys(node, prefix=""):
    for key, value in node.items():
        if key in ("defaults", "hydra") and not prefix:
            continue  # hydra's own settings, not Ballast keys
        yield prefix + key
        if isinstance(value, dict):
            yield from _yaml_keys(value, f"{prefix}{key}.")


def _names_read(exclude) -> set:
    """Attribute names and plain identifier strings (`getattr(x, "k")`, `select(raw, "a.k")`) used in
    ballast/ outside `exclude`; docstrings and message text do not count."""
    names = set()
    for path in PKG.rglob("*.py"):
        if any(path.is_relative_to(e) if e.is_dir() else path == e for e in exclude):
            continue
        tree = ast.parse(path.read_text())
        skip = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}
        skip |= {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                names.add(node.attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
                if all(part.isidentifier() for part in node.value.split(".")):
                    names.add(node.value.rsplit(".", 1)[-1])
    return names


@pytest.mark.parametrize("yaml_file", sorted(p.name for p in CONFIG_DIR.glob("*.yaml")))
def test_every_yaml_key_has_a_documented_schema_field(yaml_file):
    docs = _field_docs()
    fields = {key: (owner, name) for key, owner, name, _ in _schema_fields()}
    raw = yaml.safe_load((CONFIG_DIR / yaml_file).read_text())
    undocumented = [key for key in _yaml_keys(raw) if key not in fields or not docs.get(fields[key])]
    assert not undocumented, f"{yaml_file}: keys without a documented schema field:\n" + "\n".join(undocumented)


def test_every_schema_field_is_documented():
    missing = [f"{owner}.{name}" for (owner, name), doc in _field_docs().items() if not doc]
    assert not missing, "schema fields without a docstring under them:\n" + "\n".join(missing)


def test_every_schema_field_is_read_outside_the_schema_and_loader():
    docs = _field_docs()
    read = _names_read(exclude=[SCHEMA_DIR, PKG / "trainer" / "config" / "loader.py"])
    unread = [key for key, owner, name, section in _schema_fields()
              if not section and name not in read and not (docs.get((owner, name)) or "").startswith(UNREAD_OK)]
    assert not unread, "keys nothing reads (remove them, or document them as accepted for verl compatibility):\n" \
        + "\n".join(unread)
