"""Which packages the distribution holds, found rather than listed: every folder with an
__init__.py under backend/, kernels/ and client/ becomes a subpackage of `pagedserve`
(pyproject.toml holds everything else). A hand-kept list once left out
`pagedserve.backend.distributed`, and the installed package could not load its engine."""

from setuptools import find_packages, setup

PARTS = ("backend", "kernels", "client")

setup(
    packages=[f"pagedserve.{name}" for name in find_packages(include=[*PARTS, *(f"{part}.*" for part in PARTS)])],
    package_dir={f"pagedserve.{part}": part for part in PARTS},
)
