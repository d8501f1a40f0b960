"""Imports flow one way (docs/layers.md): every module sits in the layer its path names and imports
only its own layer or those below, and no modules import each other in a cycle. Every import counts,
also those inside functions (they are read with ``ast``, not executed) and a Cython module's
(``import``/``cimport`` lines), so a lazy import cannot hide an upward import or a cycle. No module
is exempt by its name: the application's modules are in ``dosa/app/``, whose path says its layer."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: the layer of each folder (the longest prefix of a module's name that is listed decides); a module
#: may import its own layer and those below
LAYERS = {
    "dosa": 0,                   # wire format + packetizer, job, env, UDP endpoint, offload's shared, errors
    "dataplane": 1, "host_lib": 1,
    "dpu_fw": 2, "control": 2,   # dpu_fw imports no host_lib (FORBIDDEN)
    "testbed": 3,
    "benchmarks": 4, "examples": 4,
    "dosa.app": 5,               # the dosa command, its registrations, the demo
    "dosa.__main__": 5,          # python -m dosa: Python wants it at the package's top; it calls dosa.app
}
TOP_PACKAGES = sorted({p.split(".")[0] for p in LAYERS})

def layer_of(module: str) -> tuple[str, int]:
    """(the LAYERS key that decides, its layer) for ``module``."""
    keys = [k for k in LAYERS if module == k or module.startswith(k + ".")]
    key = max(keys, key=len)
    return key, LAYERS[key]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    mods = {}
    for pkg in TOP_PACKAGES:
        for suffix in ("*.py", "*.pyx"):
            for path in sorted((ROOT / pkg).rglob(suffix)):
                mods[module_name(path)] = path
    return mods


_CY_IMPORT = re.compile(r"^\s*(?:from\s+(\.*[\w.]*)\s+c?import\s+\(?([\w\s,]+)|c?import\s+([\w.]+))", re.M)


def imported_names(path: Path, module: str) -> set[str]:
    """Absolute names ``path`` imports, at any depth: ``import a.b`` gives ``a.b``; ``from a import
    n`` gives ``a.n`` (which is ``a`` when ``n`` is not a module, see :func:`resolve`)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def absolute(base: str, level: int) -> str:
        if not level:
            return base
        parts = package.split(".")
        return ".".join(parts[:len(parts) - level + 1] + ([base] if base else []))

    out = set()
    if path.suffix == ".pyx":  # Cython: read the import lines, not the syntax tree
        for frm, names, plain in _CY_IMPORT.findall(path.read_text()):
            if plain:
                out.add(plain)
            else:
                level = len(frm) - len(frm.lstrip("."))
                base = absolute(frm.lstrip("."), level)
                out.update(f"{base}.{n.strip()}" for n in names.split(",") if n.strip())
        return out
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = absolute(node.module or "", node.level)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


def resolve(name: str, mods) -> str | None:
    """The project module ``name`` names: itself, or the longest module prefix of it (``a.n`` is
    the module ``a`` when ``n`` is a name inside it); None outside the project."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports. A package's ``__init__`` importing its own
    submodules is how a package exports them, not a dependency a reader trips on: left out."""
    mods = project_modules()
    graph = {m: set() for m in mods}
    for m, path in mods.items():
        for name in imported_names(path, m):
            dst = resolve(name, mods)
            if dst and dst != m and not dst.startswith(m + "."):
                graph[m].add(dst)
    return graph


def edges_of(graph) -> list[tuple[str, str]]:
    return sorted((s, d) for s, ds in graph.items() for d in ds)


def layer_violations(edges) -> list[tuple[str, str]]:
    return [(s, d) for s, d in edges if layer_of(d)[1] > layer_of(s)[1]]


def describe(edge) -> str:
    (s, d), (ks, ls), (kd, ld) = edge, layer_of(edge[0]), layer_of(edge[1])
    return f"{s} (layer {ls}, {ks}) imports {d} (layer {ld}, {kd})"


def cycles(graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return sorted(out)


#: (importer, imported) pairs the layers would allow but the design does not: what both need is in
#: the bottom layer (the DPU worker sends and parses packets with dosa.packetizer/dosa.transport and
#: shares the offload's pieces through dosa.offload, not through host_lib)
FORBIDDEN = [("dpu_fw", "host_lib")]


def forbidden_imports(edges) -> list[str]:
    return [f"{s} imports {d}" for s, d in edges
            if (s.split(".")[0], d.split(".")[0]) in FORBIDDEN]


@pytest.fixture(scope="module")
def graph():
    return import_graph()


@pytest.mark.timeout(60)
def test_every_top_level_package_has_a_layer():
    on_disk = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests", "build"}
    assert on_disk <= set(TOP_PACKAGES), f"packages without a layer: {sorted(on_disk - set(TOP_PACKAGES))}"


@pytest.mark.timeout(60)
def test_no_module_imports_a_layer_above_its_own(graph):
    bad = layer_violations(edges_of(graph))
    assert [describe(e) for e in bad] == []


@pytest.mark.timeout(60)
def test_no_modules_import_each_other_in_a_cycle(graph):
    assert cycles(graph) == []


@pytest.mark.timeout(60)
def test_dpu_fw_does_not_import_host_lib(graph):
    assert forbidden_imports(edges_of(graph)) == []


@pytest.mark.timeout(60)
def test_the_checks_catch_an_upward_import_and_a_cycle_of_modules_in_one_package(tmp_path):
    """The checker itself: an import inside a function is read; an upward import (the application
    imported from the bottom) and a cycle of three modules of one package are both reported."""
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from testbed.core import Testbed\n    from .sibling import x\n")
    found = imported_names(src, "dosa.m")
    assert "testbed.core.Testbed" in found and "dosa.sibling.x" in found
    cy = tmp_path / "e.pyx"
    cy.write_text("from dosa._net cimport (A,\n    B)\ncdef f():\n    import os\n")
    assert imported_names(cy, "host_lib.e") == {"dosa._net.A", "dosa._net.B", "os"}
    edges = [("dosa.wire", "testbed.core"), ("host_lib.client", "dosa.app.cli"),
             ("dosa.app.cli", "testbed.core"), ("dosa.__main__", "dosa.app.cli")]
    assert [describe(e) for e in layer_violations(edges)] == [
        "dosa.wire (layer 0, dosa) imports testbed.core (layer 3, testbed)",
        "host_lib.client (layer 1, host_lib) imports dosa.app.cli (layer 5, dosa.app)"]
    g = {"host_lib.client": {"host_lib.round"}, "host_lib.round": {"host_lib.stream"},
         "host_lib.stream": {"host_lib.client", "dosa.wire"}, "dosa.wire": set(),
         "dosa.job": {"dosa.wire"}}
    assert cycles(g) == [["host_lib.client", "host_lib.round", "host_lib.stream"]]
    assert forbidden_imports([("dpu_fw.worker", "host_lib.client"), ("host_lib.client", "dosa.wire")]) \
        == ["dpu_fw.worker imports host_lib.client"]


@pytest.mark.timeout(60)
def test_the_pure_bottom_layer_imports_without_the_compiled_extension():
    """``dosa.wire`` and the rest of the bottom layer's pure modules (and the scapy layer and capture
    tools on them) import without ``dosa._net``: only the UDP endpoint and the packetizer need a
    build. Checked in a fresh interpreter in which importing ``dosa._net`` fails."""
    import subprocess
    import sys
    code = ("import sys; sys.modules['dosa._net'] = None\n"
            "import dosa.wire, dosa.job, dosa.env, dosa.net, dosa.errors, dosa.join\n"
            "import dosa.scapy_layer, dosa.capture\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=50)
    assert r.returncode == 0, r.stderr
