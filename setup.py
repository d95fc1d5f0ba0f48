"""The package's one compiled part; everything else is declared in pyproject.toml.

The fused optimiser steps (tensile_db/runtime/fused.py) are a plain C library that ctypes loads,
built as an extension so that installing the package compiles it. Optional: without a C compiler
the package installs and the steps run as NumPy passes. -ffp-contract=off and no fast-math keep
its results those of the NumPy kernels, bit for bit; -fopenmp for the GNU OpenMP threads oneDNN
runs on too.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "tensile_db.runtime._fused", sources=["tensile_db/runtime/_fused.c"],
    extra_compile_args=["-O3", "-ffp-contract=off", "-fno-math-errno", "-fopenmp"],
    extra_link_args=["-fopenmp"], optional=True)])
