"""Imports flow one way (docs/layers.md): a top-level package imports only packages of its own layer
or below, the top-level packages' imports form no cycle, and nothing but an entry point imports an
entry point. Every import counts, also those inside functions (they are read with ``ast``, not
executed), so a lazy import cannot hide a cycle."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: layer of each top-level package; a package may import its own layer and those below
LAYERS = {
    "dosa": 0,                   # wire format + packetizer, job, env, UDP endpoint, offload's shared, errors
    "dataplane": 1, "host_lib": 1,
    "dpu_fw": 2, "control": 2,   # dpu_fw imports no host_lib (FORBIDDEN)
    "testbed": 3,
    "benchmarks": 4, "examples": 4,
}


def is_entry_point(module: str) -> bool:
    """The CLI modules, ``__main__`` and the demo: on top of everything, imported by nothing else."""
    last = module.rsplit(".", 1)[-1]
    return last in ("cli", "__main__") or last.endswith("_cli") or module.startswith("dosa.demo")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, module: str) -> set[str]:
    """Absolute names of every module ``path`` imports, at any depth of the syntax tree."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module
            out.add(prefix)
            out.update(f"{prefix}.{a.name}" for a in node.names)  # ``from pkg import module``
    return out


def project_modules() -> dict[str, Path]:
    mods = {}
    for pkg in LAYERS:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            mods[module_name(path)] = path
        for path in sorted((ROOT / pkg).rglob("*.pyx")):
            mods[module_name(path)] = path
    return mods


def import_edges() -> list[tuple[str, str]]:
    """(importer, imported) for every import of a project module by another project module."""
    mods = project_modules()
    edges = []
    for name, path in mods.items():
        if path.suffix == ".pyx":
            continue  # Cython: cimports of numpy/libc only
        for imp in imports_of(path, name):
            if imp in mods and imp != name:
                edges.append((name, imp))
    return edges


def layer_violations(edges) -> list[str]:
    bad = []
    for src, dst in edges:
        if is_entry_point(src):
            continue
        if is_entry_point(dst):
            bad.append(f"{src} imports the entry point {dst}")
            continue
        s, d = src.split(".")[0], dst.split(".")[0]
        if LAYERS[d] > LAYERS[s]:
            bad.append(f"{src} (layer {LAYERS[s]}, {s}) imports {dst} (layer {LAYERS[d]}, {d})")
    return bad


def package_cycles(edges) -> list[list[str]]:
    """Cycles of the graph between top-level packages (entry points left out)."""
    graph: dict[str, set[str]] = {p: set() for p in LAYERS}
    for src, dst in edges:
        if is_entry_point(src) or is_entry_point(dst):
            continue
        s, d = src.split(".")[0], dst.split(".")[0]
        if s != d:
            graph[s].add(d)
    cycles, state = [], {}

    def visit(p, stack):
        state[p] = "open"
        stack.append(p)
        for q in sorted(graph[p]):
            if state.get(q) == "open":
                cycles.append(stack[stack.index(q):] + [q])
            elif q not in state:
                visit(q, stack)
        stack.pop()
        state[p] = "done"

    for p in sorted(graph):
        if p not in state:
            visit(p, [])
    return cycles


def test_every_top_level_package_has_a_layer():
    on_disk = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests", "build"}
    assert on_disk <= set(LAYERS), f"packages without a layer in LAYERS: {sorted(on_disk - set(LAYERS))}"


def test_no_package_imports_a_layer_above_it_or_an_entry_point():
    assert layer_violations(import_edges()) == []


def test_top_level_packages_import_each_other_without_cycles():
    assert package_cycles(import_edges()) == []


#: (importer, imported) pairs the layers would allow but the design does not: what both need is in
#: the bottom layer (the DPU worker sends and parses packets with dosa.packetizer/dosa.transport and
#: shares the offload's pieces through dosa.offload, not through host_lib)
FORBIDDEN = [("dpu_fw", "host_lib")]


def forbidden_imports(edges) -> list[str]:
    return [f"{src} imports {dst}" for src, dst in edges
            if (src.split(".")[0], dst.split(".")[0]) in FORBIDDEN and not is_entry_point(src)]


def test_dpu_fw_does_not_import_host_lib():
    assert forbidden_imports(import_edges()) == []


def test_the_checks_catch_a_violation_and_a_cycle(tmp_path):
    """The checker itself: an upward import and a two-package cycle are both reported, an import
    inside a function included."""
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from testbed.core import Testbed\n    from .sibling import x\n")
    found = imports_of(src, "dosa.m")
    assert "testbed.core" in found and "dosa.sibling" in found
    edges = [("dosa.wire", "testbed.core"), ("testbed.core", "dosa.wire"), ("dosa.cli", "testbed.core"),
             ("host_lib.client", "dosa.cli")]
    assert layer_violations(edges) == ["dosa.wire (layer 0, dosa) imports testbed.core (layer 3, testbed)",
                                       "host_lib.client imports the entry point dosa.cli"]
    assert package_cycles(edges) == [["dosa", "testbed", "dosa"]]
    assert forbidden_imports([("dpu_fw.worker", "host_lib.client"), ("host_lib.client", "dosa.wire"),
                              ("dpu_fw.cli", "host_lib.client")]) == ["dpu_fw.worker imports host_lib.client"]


def test_the_pure_bottom_layer_imports_without_the_compiled_extension():
    """``dosa.wire`` and the rest of the bottom layer's pure modules (and the scapy layer and capture
    tools on them) import without ``dosa._net``: only the UDP endpoint and the packetizer need a
    build. Checked in a fresh interpreter in which importing ``dosa._net`` fails."""
    import subprocess
    import sys
    code = ("import sys; sys.modules['dosa._net'] = None\n"
            "import dosa.wire, dosa.job, dosa.env, dosa.net, dosa.errors, dosa.join\n"
            "import dosa.scapy_layer, dosa.capture\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
