"""The one native module (bridge/residency/_cells.c). Optional: without a C
compiler the package installs all the same and uses its Python cells."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("bridge.residency._cells", ["bridge/residency/_cells.c"],
                             extra_compile_args=["-O2"], optional=True)])
