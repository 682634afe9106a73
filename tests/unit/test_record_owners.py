"""One writer per record (issue 30): each live record of an ``Endpoint`` is written by the one
module its docstring names, and every other module only reads it.

The check is syntactic. It parses every module under ``pdproxy/`` and finds each write to a
record: an assignment (plain, augmented, annotated, in a tuple, through a subscript or
``del``) to ``<x>.<record>.<field>``, a call of a mutating method on one of its fields
(``<x>.legs.kv_sources.clear()``) or of one of the record's own methods
(``<x>.legs.read_from(...)``), ``setattr`` on it, and the same through a local name bound to
the record or one of its fields (``health = endpoint.health``; ``health.probe = ...``) or a
parameter annotated with its class. Replacing a record whole (``<x>.legs = ...``) is a write
of the slot: which record an ``Endpoint`` holds is the fleet registry's business, and its
identity the membership's re-identification. ``dataclasses.replace`` makes a new record and
writes nothing until it is assigned, which is caught then.
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path

import pytest

import pdproxy

PACKAGE = Path(pdproxy.__file__).parent

# The attribute of ``Endpoint`` holding each record -> (its class, its one writer).
RECORDS = {
    "legs": ("LegCounts", "pdproxy.proxying.leg_counts"),
    "health": ("EndpointHealth", "pdproxy.resilience.outlier"),
    "presence": ("Presence", "pdproxy.fleet.registry"),
    "load": ("EngineFigures", "pdproxy.membership.load_scraper"),
    "speed": ("Speed", "pdproxy.scheduling.speed"),
    "identity": ("EndpointIdentity", "pdproxy.membership.identity"),
}
# Who sets which record object an ``Endpoint`` holds (``<x>.<record> = ...``).
SLOT_WRITERS = {record: "pdproxy.fleet.registry" for record in RECORDS} | {
    "identity": "pdproxy.membership.identity"
}
# Attributes that share a record's name in a module where they are something else.
NOT_THE_RECORD = {
    # a continued stream's response id fields (id, created, model), not EndpointIdentity
    ("pdproxy.wire.continuation", "identity"),
}
MUTATORS = frozenset(
    [
        "append",
        "extend",
        "insert",
        "pop",
        "popitem",
        "remove",
        "clear",
        "update",
        "setdefault",
        "add",
        "discard",
        "sort",
        "reverse",
        "__setitem__",
        "__delitem__",
    ]
)


@dataclass(frozen=True, order=True)
class Write:
    module: str
    line: int
    record: str
    what: str  # the field written, or "" for the slot

    def __str__(self) -> str:
        target = f"{self.record}.{self.what}" if self.what else f"the {self.record} slot"
        return f"{self.module}:{self.line} writes {target}"


def record_methods() -> dict[str, frozenset[str]]:
    """The methods each record class defines (``LegCounts.read_from``): calling one writes."""
    tree = ast.parse((PACKAGE / "types.py").read_text())
    classes = {cls: record for record, (cls, _) in RECORDS.items()}
    methods: dict[str, frozenset[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name in classes:
            defs = (f.name for f in node.body if isinstance(f, ast.FunctionDef))
            methods[classes[node.name]] = frozenset(n for n in defs if not n.startswith("__"))
    return methods


class _Scope:
    """The writes in one function (or module body), its local aliases resolved."""

    def __init__(self, module: str, node: ast.AST, methods: dict[str, frozenset[str]]) -> None:
        self.module = module
        self.methods = methods
        self.records: dict[str, str] = {}  # local name -> the record it is bound to
        self.fields: dict[str, tuple[str, str]] = {}  # local name -> (record, field)
        self._bind(node)

    def _skip(self, record: str) -> bool:
        return (self.module, record) in NOT_THE_RECORD

    def _bind(self, node: ast.AST) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            args = node.args
            for arg in (*args.posonlyargs, *args.args, *args.kwonlyargs):
                name = _annotation(arg.annotation)
                for record, (cls, _) in RECORDS.items():
                    if name == cls:
                        self.records[arg.arg] = record
        for sub in ast.walk(node):
            if isinstance(sub, ast.Assign) and len(sub.targets) == 1:
                target = sub.targets[0]
                if isinstance(target, ast.Name):
                    self._alias(target.id, sub.value)

    def _alias(self, name: str, value: ast.expr) -> None:
        record = self.record_of(value)
        if record is not None:
            self.records[name] = record
            return
        if isinstance(value, ast.Attribute):
            record = self.record_of(value.value)
            if record is not None:
                self.fields[name] = (record, value.attr)

    def record_of(self, node: ast.expr) -> str | None:
        """The record ``node`` is: ``<x>.<record>`` or a name bound to one."""
        if isinstance(node, ast.Attribute) and node.attr in RECORDS and not self._skip(node.attr):
            return node.attr
        if isinstance(node, ast.Name):
            return self.records.get(node.id)
        return None

    def field_of(self, node: ast.expr) -> tuple[str, str] | None:
        """(record, field) when ``node`` is a record's field or a name bound to one."""
        if isinstance(node, ast.Attribute):
            record = self.record_of(node.value)
            if record is not None:
                return record, node.attr
        if isinstance(node, ast.Name):
            return self.fields.get(node.id)
        return None

    def writes(self, node: ast.AST) -> list[Write]:
        found: list[Write] = []
        for sub in ast.walk(node):
            for target in _targets(sub):
                found.extend(self._target(target))
            if isinstance(sub, ast.Call):
                found.extend(self._call(sub))
        return found

    def _target(self, target: ast.expr) -> list[Write]:
        line = target.lineno
        if isinstance(target, ast.Tuple | ast.List):
            return [w for t in target.elts for w in self._target(t)]
        if isinstance(target, ast.Starred):
            return self._target(target.value)
        if isinstance(target, ast.Subscript):  # legs.rank_in_flight[rank] -= 1
            field = self.field_of(target.value)
            return [] if field is None else [Write(self.module, line, *field)]
        if not isinstance(target, ast.Attribute):
            return []
        field = self.field_of(target)
        if field is not None:
            return [Write(self.module, line, *field)]
        if target.attr in RECORDS and not self._skip(target.attr):
            return [Write(self.module, line, target.attr, "")]  # the slot
        return []

    def _call(self, call: ast.Call) -> list[Write]:
        func = call.func
        line = call.lineno
        if _is_setattr(func) and call.args:
            obj = call.args[0]
            name = call.args[1] if len(call.args) > 1 else None
            attr = name.value if isinstance(name, ast.Constant) else "?"
            record = self.record_of(obj)
            if record is not None:
                return [Write(self.module, line, record, str(attr))]
            if attr in RECORDS and not self._skip(str(attr)):
                return [Write(self.module, line, str(attr), "")]
            return []
        if not isinstance(func, ast.Attribute):
            return []
        record = self.record_of(func.value)
        if record is not None and func.attr in self.methods.get(record, ()):
            return [Write(self.module, line, record, func.attr + "()")]
        field = self.field_of(func.value)
        if field is not None and func.attr in MUTATORS:
            return [Write(self.module, line, *field)]
        return []


def _annotation(node: ast.expr | None) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return None


def _is_setattr(func: ast.expr) -> bool:
    if isinstance(func, ast.Name):
        return func.id == "setattr"
    return isinstance(func, ast.Attribute) and func.attr == "__setattr__"


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign | ast.Delete):
        return list(node.targets)
    if isinstance(node, ast.AugAssign | ast.AnnAssign):
        return [node.target]
    return []


def writes_in(module: str, source: str) -> list[Write]:
    """Every write to a record in ``source``, the module named ``module``."""
    tree = ast.parse(source)
    methods = record_methods()
    scopes = [
        tree,
        *(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)),
    ]
    found = {w for scope in scopes for w in _Scope(module, scope, methods).writes(scope)}
    return sorted(found)


def foreign(writes: list[Write]) -> list[Write]:
    """The writes by a module that is not the record's (or the slot's) one writer."""
    return [w for w in writes if w.module != owner_of(w)]


def owner_of(write: Write) -> str:
    return RECORDS[write.record][1] if write.what else SLOT_WRITERS[write.record]


@functools.cache
def all_writes() -> tuple[Write, ...]:
    found: list[Write] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "types.py" and path.parent == PACKAGE:
            continue  # the records' own definitions (their methods write ``self``)
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found.extend(writes_in(module, path.read_text()))
    return tuple(found)


def test_every_record_is_written_by_its_one_owner_only():
    strays = foreign(list(all_writes()))
    assert not strays, "a record written outside its owner:\n" + "\n".join(
        f"{w} (its one writer is {owner_of(w)})" for w in strays
    )


@pytest.mark.parametrize("record", sorted(RECORDS))
def test_each_owner_is_found_writing_its_record(record):
    """Else a renamed attribute or owner would empty the check above without a sound. (An
    identity is frozen: its writer replaces it whole.)"""
    owner = RECORDS[record][1]
    whole = record == "identity"
    assert any(
        w.record == record and bool(w.what) != whole and w.module == owner for w in all_writes()
    )


def test_the_registry_is_found_setting_a_slot():
    assert any(
        w.module == "pdproxy.fleet.registry" and w.record == "legs" and not w.what
        for w in all_writes()
    )


@pytest.mark.parametrize(
    ("source", "record"),
    [
        ("def f(e):\n    e.legs.reserved += 1\n", "legs"),
        ("def f(e):\n    e.health.probe = 1\n", "health"),
        ("def f(e):\n    e.presence.state, x = 1, 2\n", "presence"),
        ("def f(e):\n    e.load.capacity: int = 3\n", "load"),
        ("def f(e):\n    s = e.speed\n    s.slowness = 2.0\n", "speed"),
        ("def f(e):\n    e.identity = object()\n", "identity"),
        ("def f(h: EndpointHealth):\n    h.ejections = 0\n", "health"),
        ("def f(e):\n    e.legs.kv_sources.clear()\n", "legs"),
        ("def f(e):\n    e.legs.read_from('x')\n", "legs"),
        ("def f(e):\n    counts = e.legs.rank_in_flight\n    counts[0] -= 1\n", "legs"),
        ("def f(e):\n    del e.legs.kv_sources['x']\n", "legs"),
        ("def f(e):\n    setattr(e.health, 'probe', 1)\n", "health"),
        ("def f(e, old):\n    e.legs = old.legs\n", "legs"),
        ("def f(e):\n    setattr(e, 'presence', None)\n", "presence"),
    ],
)
def test_a_second_writer_is_reported(source, record):
    strays = foreign(writes_in("pdproxy.api.sneaky", source))
    assert [w.record for w in strays] == [record], strays


def test_the_owner_itself_and_a_reader_are_not_reported():
    source = "def f(e):\n    e.legs.in_flight += 1\n    return e.health.probe, e.load.others\n"
    assert writes_in("pdproxy.proxying.leg_counts", source) != []
    assert foreign(writes_in("pdproxy.proxying.leg_counts", source)) == []


@pytest.mark.parametrize("record", sorted(RECORDS))
def test_each_record_names_its_one_writer(record):
    cls, owner = RECORDS[record]
    tree = ast.parse((PACKAGE / "types.py").read_text())
    (node,) = (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    doc = " ".join((ast.get_docstring(node) or "").split())
    assert owner.removeprefix("pdproxy.") in doc, f"{cls}'s docstring does not name {owner}"
