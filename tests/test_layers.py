"""Dependencies point one way (DESIGN.md, "Layers"): every import of every module (late
and TYPE_CHECKING imports included) is read with ``ast`` and checked against the layer
table below. Pure: no project module is imported."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kvstore", "worker", "router", "cluster", "protos", "benchmarks", "tests")

# Rank of each layer, lowest first. A module may import a layer of lower rank and its own
# layer; never a higher rank, nor another layer of the same rank. Longest prefix wins.
LAYERS = {
    "kvstore.blocks": 0,  # block vocabulary: keys, hashing, events, request/output types
    "protos": 0,  # generated protobuf code
    "kvstore": 1,  # the Redis block index
    "worker": 2,  # engine, KV manager, model, attention, the worker actor
    "router": 3,  # placement, serving core, gRPC edge, simulator
    "cluster": 4,  # config, launcher, client, CLI
    "benchmarks": 5,
    "tests": 6,
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> str:
    best = max(
        (name for name in LAYERS if module == name or module.startswith(name + ".")), key=len
    )
    # A package's __init__ runs whenever any module below it is imported, so it belongs to
    # the lowest layer inside it (kvstore/__init__ must not pull the index into the ground).
    inner = [name for name in LAYERS if name.startswith(module + ".")]
    if inner:
        best = min(inner + [best], key=LAYERS.__getitem__)
    return best


def imports_of(path: Path, module: str) -> set[str]:
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                if not is_pkg:
                    base = base[:-1]
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            # ``from pkg import mod`` imports the submodule pkg.mod
            found.update(f"{target}.{alias.name}" for alias in node.names)
    return {name for name in found if name.split(".")[0] in PACKAGES}


def project_modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if "_pb2" not in path.name:
                modules[module_name(path)] = path
    return modules


def known(name: str, modules: dict[str, Path]) -> str | None:
    """The project module ``name`` refers to (``pkg.mod.Name`` -> ``pkg.mod``)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def test_no_module_imports_a_layer_above_its_own() -> None:
    modules = project_modules()
    bad = []
    for module, path in sorted(modules.items()):
        own = layer_of(module)
        for name in sorted(imports_of(path, module)):
            target = known(name, modules)
            if target is None:
                continue
            other = layer_of(target)
            if other != own and LAYERS[other] >= LAYERS[own]:
                bad.append(f"{module} ({own}) imports {target} ({other})")
    assert not bad, "imports against the layers:\n" + "\n".join(bad)


def unit_of(module: str, modules: dict[str, Path]) -> str:
    """The subpackage a module belongs to (``router.placement``), else its top package."""
    parts = module.split(".")
    if len(parts) >= 2 and (ROOT / parts[0] / parts[1]).is_dir():
        return ".".join(parts[:2])
    return parts[0]


def test_no_two_packages_import_each_other() -> None:
    modules = project_modules()
    edges: dict[str, set[str]] = defaultdict(set)
    for module, path in modules.items():
        if module.startswith("tests"):
            continue
        src = unit_of(module, modules)
        for name in imports_of(path, module):
            target = known(name, modules)
            if target is not None and unit_of(target, modules) != src:
                edges[src].add(unit_of(target, modules))
    cycles = []
    for src, targets in sorted(edges.items()):
        for dst in sorted(targets):
            if src < dst and src in edges.get(dst, set()):
                cycles.append(f"{src} <-> {dst}")
            # longer loops: dst reaches src
            seen, stack = {dst}, [dst]
            while stack:
                for nxt in edges.get(stack.pop(), ()):
                    if nxt == src and dst != src and src < dst:
                        cycles.append(f"{src} -> {dst} -> ... -> {src}")
                        stack.clear()
                        break
                    if nxt not in seen:
                        seen.add(nxt)
                        stack.append(nxt)
    assert not cycles, "packages importing each other:\n" + "\n".join(sorted(set(cycles)))


def test_layer_table_catches_an_upward_import(tmp_path: Path) -> None:
    """The checker itself: an upward import and a package-init pull are both reported."""
    assert layer_of("kvstore.blocks.hashing") == "kvstore.blocks"
    assert layer_of("kvstore") == "kvstore.blocks"  # its __init__ runs for the ground too
    assert layer_of("kvstore.index") == "kvstore"
    assert layer_of("router.sim.worker") == "router"
    assert LAYERS[layer_of("worker.kv.manager")] > LAYERS[layer_of("kvstore.publisher")]


def test_router_and_ground_load_without_torch() -> None:
    """The router (tokenizer and default model included) loads without paying for torch."""
    code = (
        "import sys, router.server, router.edge.servicer, kvstore.blocks.protocol; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
