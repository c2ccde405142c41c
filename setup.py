"""Maps the top-level folders to the ``bulkhead.*`` packages.

A top-level package named ``operator`` would shadow Python's standard module, so the
folders are installed as ``bulkhead.api``, ``bulkhead.operator``, ``bulkhead.agent``,
``bulkhead.trainer`` and ``bulkhead.cli``; ``bulkhead`` itself is a namespace package.
"""

from pathlib import Path

from setuptools import setup

ROOTS = ("api", "operator", "agent", "trainer", "cli")
HERE = Path(__file__).parent


def _packages() -> list[str]:
    found = []
    for root in ROOTS:
        for init in sorted((HERE / root).rglob("__init__.py")):
            rel = init.parent.relative_to(HERE / root)
            found.append(".".join(("bulkhead", root, *rel.parts)))
    return found


setup(
    packages=_packages(),
    package_dir={f"bulkhead.{root}": root for root in ROOTS},
    package_data={"bulkhead.api": ["py.typed"], "bulkhead.trainer": ["presets/*.yaml"]},
)
