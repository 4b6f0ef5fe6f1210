"""Classes are composed, not fragmented (STYLE.md 1): every piece of mutable state has one
owning class. A product class must not declare class-level attributes that none of its own
methods initialise (state another file creates), and must not be assembled from two or more
project base classes (capabilities several classes share go in ``SHARED_CAPABILITIES``).
Pure: modules are read with ``ast``, nothing is imported."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("kvstore", "worker", "router", "cluster")

# Value-type and interface bases: their class-level annotations are fields, not borrowed state.
RECORD_BASES = {
    "ABC",
    "BaseModel",
    "Enum",
    "Exception",
    "IntEnum",
    "NamedTuple",
    "Protocol",
    "StrEnum",
    "Strict",
    "TypedDict",
}
RECORD_DECORATORS = {"dataclass"}
# Project bases that stand for a capability shared by several classes (a genuine mixin).
SHARED_CAPABILITIES = {
    # the HTTP edge's connection bounds, mixed into both of uvicorn's protocol classes; its
    # annotations name uvicorn's attributes for the type checker
    "_Bounds",
}


@dataclass
class ClassInfo:
    path: Path
    node: ast.ClassDef

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.node.lineno} {self.node.name}"

    def base_names(self) -> list[str]:
        names = []
        for b in self.node.bases:
            b = b.value if isinstance(b, ast.Subscript) else b
            if isinstance(b, ast.Name):
                names.append(b.id)
            elif isinstance(b, ast.Attribute):
                names.append(b.attr)
        return names

    def decorator_names(self) -> set[str]:
        names = set()
        for d in self.node.decorator_list:
            d = d.func if isinstance(d, ast.Call) else d
            names.add(d.id if isinstance(d, ast.Name) else getattr(d, "attr", ""))
        return names


def product_classes() -> dict[str, list[ClassInfo]]:
    found: dict[str, list[ClassInfo]] = {}
    for pkg in PRODUCT:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if "_pb2" in path.name:
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ClassDef):
                    found.setdefault(node.name, []).append(ClassInfo(path, node))
    return found


CLASSES = product_classes()


def is_record(info: ClassInfo, seen: frozenset[str] = frozenset()) -> bool:
    """A dataclass, protocol, ABC, exception, enum or config model, or a class derived from
    one through project classes."""
    if info.decorator_names() & RECORD_DECORATORS:
        return True
    for base in info.base_names():
        if base in RECORD_BASES or base.endswith(("Error", "Exception")):
            return True
        if base in CLASSES and base not in seen:
            if any(is_record(b, seen | {base}) for b in CLASSES[base]):
                return True
    return False


def declared(node: ast.ClassDef) -> set[str]:
    """Class-level annotations without a value."""
    return {
        s.target.id
        for s in node.body
        if isinstance(s, ast.AnnAssign) and s.value is None and isinstance(s.target, ast.Name)
    }


def initialised(node: ast.ClassDef) -> set[str]:
    """Names the class assigns: at class level, or on ``self`` in its own methods."""
    names: set[str] = set()
    for s in node.body:
        if isinstance(s, ast.Assign):
            names.update(t.id for t in s.targets if isinstance(t, ast.Name))
        elif isinstance(s, ast.AnnAssign) and s.value is not None:
            if isinstance(s.target, ast.Name):
                names.add(s.target.id)
        elif isinstance(s, ast.FunctionDef | ast.AsyncFunctionDef):
            for n in ast.walk(s):
                targets = []
                if isinstance(n, ast.Assign):
                    targets = n.targets
                elif isinstance(n, ast.AnnAssign | ast.AugAssign):
                    targets = [n.target]
                for t in targets:
                    for el in t.elts if isinstance(t, ast.Tuple) else [t]:
                        if (
                            isinstance(el, ast.Attribute)
                            and isinstance(el.value, ast.Name)
                            and el.value.id == "self"
                        ):
                            names.add(el.attr)
                if (
                    isinstance(n, ast.Call)
                    and isinstance(n.func, ast.Name)
                    and n.func.id == "setattr"
                    and len(n.args) >= 2
                    and isinstance(n.args[1], ast.Constant)
                ):
                    names.add(str(n.args[1].value))
    return names


def slot_names(node: ast.ClassDef) -> set[str]:
    for s in node.body:
        if isinstance(s, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__slots__" for t in s.targets
        ):
            if isinstance(s.value, ast.Tuple | ast.List):
                return {e.value for e in s.value.elts if isinstance(e, ast.Constant)}
    return set()


def test_no_class_declares_state_it_does_not_initialise():
    offenders = []
    for infos in CLASSES.values():
        for info in infos:
            if is_record(info) or info.node.name in SHARED_CAPABILITIES:
                continue
            missing = declared(info.node) - initialised(info.node) - slot_names(info.node)
            if missing:
                offenders.append(f"{info.where}: {sorted(missing)}")
    assert not offenders, "classes declaring state another class creates:\n" + "\n".join(offenders)


def test_no_class_is_assembled_from_several_project_bases():
    offenders = []
    for infos in CLASSES.values():
        for info in infos:
            project = [
                b for b in info.base_names() if b in CLASSES and b not in SHARED_CAPABILITIES
            ]
            if len(project) >= 2:
                offenders.append(f"{info.where}: {project}")
    assert not offenders, "classes built from several project bases:\n" + "\n".join(offenders)


def test_the_checks_see_a_fragment():
    """The rules catch the pattern they exist for (guards the checker itself)."""
    src = """
class Fragment:
    _pool: object
    def evict(self):
        return self._pool.pop()

class Owner(Fragment, Other):
    def __init__(self):
        self._pool = []
"""
    tree = ast.parse(src)
    fragment, owner = (n for n in tree.body if isinstance(n, ast.ClassDef))
    assert declared(fragment) - initialised(fragment) == {"_pool"}
    assert declared(owner) - initialised(owner) == set()
