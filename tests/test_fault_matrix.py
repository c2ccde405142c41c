"""The fault matrix names real tests, and README shows exactly that matrix."""

from __future__ import annotations

import ast

from fault_matrix import FAULTS, README, ROOT, readme_section, table


def _test_functions(path: str) -> set[str]:
    tree = ast.parse((ROOT / path).read_text())
    functions = (ast.FunctionDef, ast.AsyncFunctionDef)
    return {node.name for node in tree.body if isinstance(node, functions)}


def test_every_named_test_exists() -> None:
    missing = []
    for fault in FAULTS:
        for node_id in fault.tests:
            path, _, name = node_id.partition("::")
            if name not in _test_functions(path):
                missing.append(f"{fault.fault}: {node_id}")
    assert missing == []


def test_the_readme_table_is_the_matrix() -> None:
    assert readme_section(README.read_text()) == table(), (
        "README's 'Faults we survive' table is stale: run python tests/fault_matrix.py"
    )


def test_uncovered_faults_say_so() -> None:
    for fault in FAULTS:
        assert bool(fault.tests) != fault.outcome.startswith("not covered"), fault.fault
