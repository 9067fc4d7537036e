"""The controller's state has owners (docs/architecture.md, "Who owns what in the controller"): an attribute
of a class of `prefect_elastic/training/` is assigned or changed in place only by that class's own methods
(`self.f = ...`, `self.f.add(...)`); any other object asks the owner, with a method that says what happened
(`RoleTable.move`, `Workers.worker_left`, ...). Read from the code (AST), as tests/unit/test_layout.py
reads the package's shape."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "prefect_elastic"
OWNERS = PACKAGE / "training"

# The methods that change a set, a list, a dict or a Counter in place.
MUTATORS = {
    "add", "discard", "remove", "append", "extend", "insert", "pop", "popitem", "clear", "update",
    "setdefault", "difference_update", "intersection_update", "symmetric_difference_update", "sort",
    "reverse",
}  # fmt: skip
COLLECTIONS = {"set", "list", "dict", "Counter", "defaultdict", "deque", "frozenset"}

# Writes from outside an owner, each with its reason: (file, attribute) -> why.
ALLOWED: dict[tuple[str, str], str] = {
    # `Persistence.plan` (checkpoint/), not the role table's: the checkpoint joins a shard's parts by the
    # plan the start made, and the start makes it (`Actors.start_servers`).
    ("actors.py", "plan"): "another package's object, named alike",
}


def is_collection(value: ast.expr | None, annotation: ast.expr | None) -> bool:
    if isinstance(value, ast.Set | ast.List | ast.Dict | ast.ListComp | ast.SetComp | ast.DictComp):
        return True
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id in COLLECTIONS:
        return True
    head = annotation.value if isinstance(annotation, ast.Subscript) else annotation
    return isinstance(head, ast.Name) and head.id in COLLECTIONS


def owned() -> tuple[dict[str, set[str]], set[str], set[str]]:
    """Per class of training/, the attributes its methods assign on `self`; all of them; and those that
    hold a collection."""
    by_class: dict[str, set[str]] = {}
    collections: set[str] = set()
    for path in sorted(OWNERS.glob("*.py")):
        for cls in ast.walk(ast.parse(path.read_text())):
            if not isinstance(cls, ast.ClassDef):
                continue
            attrs = by_class.setdefault(cls.name, set())
            for node in ast.walk(cls):
                pairs: list[tuple[ast.expr, ast.expr | None, ast.expr | None]] = []
                if isinstance(node, ast.Assign):
                    pairs = [(t, node.value, None) for t in node.targets]
                elif isinstance(node, ast.AnnAssign):
                    pairs = [(node.target, node.value, node.annotation)]
                for target, value, annotation in pairs:
                    if isinstance(target, ast.Attribute) and is_self(target.value):
                        attrs.add(target.attr)
                        if is_collection(value, annotation):
                            collections.add(target.attr)
    return by_class, set().union(*by_class.values()), collections


def is_self(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"


def written(target: ast.expr) -> list[ast.Attribute]:
    """The attributes an assignment's (or a `del`'s) target writes: `x.f = `, `x.f[k] = `, in tuples."""
    if isinstance(target, ast.Tuple | ast.List):
        return [a for t in target.elts for a in written(t)]
    if isinstance(target, ast.Starred):
        return written(target.value)
    if isinstance(target, ast.Subscript) and isinstance(target.value, ast.Attribute):
        return [target.value]
    return [target] if isinstance(target, ast.Attribute) else []


def reaches_the_owners(path: Path, tree: ast.AST) -> bool:
    """Whether a module can hold an owner: one of training/, or one that imports from it (the other
    packages' objects have attributes named alike, `channels`, `plan`, which are theirs)."""
    return path.parent == OWNERS or any(
        isinstance(node, ast.ImportFrom) and "training" in (node.module or "").split(".")
        for node in ast.walk(tree)
    )


def sites_of(node: ast.AST, collections: set[str]) -> list[ast.Attribute]:
    """The attributes `node` writes, or changes in place with a collection's method."""
    if isinstance(node, ast.Assign | ast.Delete):
        return [a for t in node.targets for a in written(t)]
    if isinstance(node, ast.AugAssign | ast.AnnAssign):
        return written(node.target)
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in MUTATORS
        and isinstance(node.func.value, ast.Attribute)
        and node.func.value.attr in collections
    ):
        return [node.func.value]
    return []


def writes_from_outside(
    sources: dict[str, ast.AST] | None = None, allowed: dict[tuple[str, str], str] = ALLOWED
) -> list[str]:
    """Each write of an owner's attribute outside the owner's methods, as `file:line: what (class)`."""
    _, attrs, collections = owned()
    if sources is None:
        sources = {
            str(p.relative_to(PACKAGE.parent)): tree
            for p in sorted(PACKAGE.rglob("*.py"))
            if reaches_the_owners(p, tree := ast.parse(p.read_text()))
        }
    found = []

    def visit(node: ast.AST, cls: str, name: str) -> None:
        cls = node.name if isinstance(node, ast.ClassDef) else cls
        for site in sites_of(node, collections):
            if site.attr not in attrs or is_self(site.value):
                continue  # not an owner's attribute; or the class's own (`self.f`)
            if (Path(name).name, site.attr) not in allowed:
                found.append(f"{name}:{site.lineno}: {ast.unparse(site)} ({cls or 'module'})")
        for child in ast.iter_child_nodes(node):
            visit(child, cls, name)

    for name, tree in sources.items():
        visit(tree, "", name)
    return found


def test_an_owners_attribute_is_written_only_by_its_own_methods() -> None:
    where = writes_from_outside()
    assert not where, "\n".join(where)


def test_each_write_allowed_is_still_there() -> None:
    found = writes_from_outside(allowed={})
    stale = [k for k in ALLOWED if not any(f"{k[0]}:" in f and f".{k[1]} (" in f for f in found)]
    assert not stale, stale


def test_the_check_sees_each_kind_of_write_from_outside() -> None:
    by_class, _, collections = owned()
    assert {"placement", "channels", "coordinator_at"} <= by_class["RoleTable"], by_class["RoleTable"]
    assert {"placement", "channels"} <= collections
    other = ast.parse(
        "class Other:\n"
        "    def f(self, roles):\n"
        "        roles.placement[0] = 'w'\n"
        "        self.roles.channels.append(1)\n"
        "        roles.coordinator_at = 'w'\n"
        "        roles.channels.clear()\n"
        "        self.placement = []  # (Other's own, though RoleTable has one too)\n"
        "        self.channels.add(2)\n"
    )
    found = writes_from_outside({"other.py": other})
    assert [f.split(": ")[1] for f in found] == [
        "roles.placement (Other)", "self.roles.channels (Other)", "roles.coordinator_at (Other)",
        "roles.channels (Other)",
    ], found  # fmt: skip
