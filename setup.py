"""Builds the Cython hot loops: every ``*.pyx`` under the project's packages becomes an extension.

Declared here (not in pyproject) only because setuptools needs code to glob extensions and add numpy's
include directory; all metadata lives in pyproject.toml.
"""
from pathlib import Path

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

ROOT = Path(__file__).parent
PACKAGES = ["host_lib", "dpu_fw", "dataplane", "control", "dosa"]


def extensions():
    exts = []
    for pkg in PACKAGES:
        for pyx in sorted((ROOT / pkg).rglob("*.pyx")):
            rel = pyx.relative_to(ROOT).with_suffix("")
            exts.append(Extension(
                ".".join(rel.parts), [str(pyx.relative_to(ROOT))],
                # the generated C views: dosa/dosa_wire.h (the wire), dataplane/dosa_state.h and
                # dosa_layout.h (the DPU state the XDP program and the DPU worker share)
                include_dirs=[numpy.get_include(), str(ROOT / "dosa"), str(ROOT / "dataplane")],
                extra_compile_args=["-O3"],
                define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
            ))
    return cythonize(exts, language_level=3, quiet=True,
                     compiler_directives={"boundscheck": False, "wraparound": False})


setup(ext_modules=extensions())
