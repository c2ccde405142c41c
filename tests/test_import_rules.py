"""CONTRIBUTING.md's dependency rule, checked on the import statements of every module.

Each module's imports are read from its syntax tree (nothing is imported): a module-level
import is paid when the module is imported; one inside a function only when it runs (the
lazy imports that keep torch out of ``bulkhead --help``). The rule, as CONTRIBUTING.md
states it:

- ``api`` imports nothing of ours;
- ``operator`` and ``agent`` never import ``torch``, neither themselves nor through a module
  they import at module level;
- nothing imports ``operator`` or ``agent`` (entry points name them in strings);
- ``operator`` imports ``trainer`` only in local mode (``operator/local/``), and only the
  torch-free modules its worker and sidecar processes share with it (LOCAL_MODE_TRAINER);
- ``operator/lifecycle/`` imports nothing from the drivers or the session;
- folders are imported as ``bulkhead.<name>``, never as top-level packages.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ROOTS = ("api", "operator", "agent", "trainer", "cli")
LOCAL_MODE_TRAINER = {
    "bulkhead.trainer.pod.prestart",
    "bulkhead.trainer.checkpoint.paths",
}
DRIVER_SIDE = ("driver", "k8s", "local", "session")


@dataclass(frozen=True)
class Import:
    target: str  # a dotted module name (ours with its bulkhead. prefix, or third-party)
    module_level: bool
    line: int


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(("bulkhead", *parts))


def imports_of(source: str, name: str, is_package: bool) -> list[Import]:
    """Every import in ``source`` (module ``name``), ``from X import Y`` as X and X.Y."""
    tree = ast.parse(source)
    top = {id(node) for node in tree.body}
    # Imports under a module-level if/try (e.g. TYPE_CHECKING) count as module level too
    # unless they are inside a function or class body.
    in_function: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            in_function.update(id(inner) for inner in ast.walk(node) if inner is not node)
    out: list[Import] = []
    for node in ast.walk(tree):
        level = id(node) in top or id(node) not in in_function
        if isinstance(node, ast.Import):
            out += [Import(a.name, level, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                package = name if is_package else name.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}" if base else package
            out.append(Import(base, level, node.lineno))
            out += [Import(f"{base}.{a.name}", level, node.lineno) for a in node.names]
    return out


def load_tree(repo: Path) -> dict[str, tuple[str, list[Import]]]:
    """Module name -> (its path from the repo root, its imports), for every package file."""
    modules = {}
    for root in ROOTS:
        for path in sorted((repo / root).rglob("*.py")):
            name = module_name(path)
            source = path.read_text()
            modules[name] = (
                str(path.relative_to(repo)),
                imports_of(source, name, path.name == "__init__.py"),
            )
    return modules


def _ours(target: str, modules: dict[str, tuple[str, list[Import]]]) -> str | None:
    """The module of ours ``target`` names (``from pkg import name`` may name a class)."""
    while target.startswith("bulkhead."):
        if target in modules:
            return target
        target = target.rpartition(".")[0]
    return None


def _is_torch(target: str) -> bool:
    return target == "torch" or target.startswith("torch.")


def _torch_at_import(modules: dict[str, tuple[str, list[Import]]]) -> dict[str, list[str]]:
    """Module -> the chain of module-level imports through which importing it imports torch."""
    chains: dict[str, list[str]] = {}
    visiting: set[str] = set()

    def chain(name: str) -> list[str] | None:
        if name in chains:
            return chains[name] or None
        if name in visiting:
            return None
        visiting.add(name)
        found: list[str] | None = None
        parents = [name.rsplit(".", i)[0] for i in range(1, name.count("."))]
        for imp in modules[name][1]:
            if not imp.module_level:
                continue
            if _is_torch(imp.target):
                found = [name, "torch"]
                break
            ours = _ours(imp.target, modules)
            if ours and ours != name:
                sub = chain(ours)
                if sub:
                    found = [name, *sub]
                    break
        if found is None:  # importing a module imports its packages' __init__ first
            for parent in parents:
                sub = chain(parent) if parent in modules else None
                if sub:
                    found = [name, *sub]
                    break
        visiting.discard(name)
        chains[name] = found or []
        return found

    for name in modules:
        chain(name)
    return {name: c for name, c in chains.items() if c}


def violations(modules: dict[str, tuple[str, list[Import]]]) -> list[str]:
    out: list[str] = []
    torch_chains = _torch_at_import(modules)
    for name, (path, imports) in modules.items():
        root = name.split(".")[1]
        for imp in imports:
            where = f"{path}:{imp.line}: imports {imp.target}"
            if imp.target.split(".")[0] in ROOTS:
                out.append(f"{where} (import bulkhead.{imp.target}, not a top-level package)")
                continue
            if _is_torch(imp.target) and root in ("operator", "agent"):
                out.append(f"{where} ({root} never imports torch)")
            ours = _ours(imp.target, modules)
            if ours is None:
                continue
            target_root = ours.split(".")[1]
            if root == "api" and target_root != "api":
                out.append(f"{where} (api imports nothing of ours)")
            if target_root in ("operator", "agent") and root != target_root:
                out.append(f"{where} (nothing imports {target_root})")
            if root == "operator" and target_root == "trainer":
                local = name.startswith("bulkhead.operator.local.")
                if not (local and ours in LOCAL_MODE_TRAINER | {"bulkhead.trainer"}):
                    out.append(f"{where} (the operator imports only {sorted(LOCAL_MODE_TRAINER)}"
                               " from trainer, in operator/local/)")  # fmt: skip
            if name.startswith("bulkhead.operator.lifecycle") and any(
                ours == f"bulkhead.operator.{d}" or ours.startswith(f"bulkhead.operator.{d}.")
                for d in DRIVER_SIDE
            ):
                out.append(f"{where} (lifecycle/ is pure: no drivers, no session)")
            if (
                root in ("operator", "agent")
                and imp.module_level
                and ours.split(".")[1] == "trainer"
                and ours in torch_chains
            ):
                out.append(f"{where} (imports torch: {' -> '.join(torch_chains[ours])})")
    return out


def test_the_tree_follows_the_dependency_rule() -> None:
    modules = load_tree(REPO)
    assert len(modules) > 100  # every package file was read
    assert violations(modules) == []


def test_local_mode_s_trainer_imports_are_the_torch_free_ones_named() -> None:
    modules = load_tree(REPO)
    torch_chains = _torch_at_import(modules)
    for allowed in LOCAL_MODE_TRAINER:
        assert allowed in modules, f"{allowed} is gone: update LOCAL_MODE_TRAINER and CONTRIBUTING"
        assert allowed not in torch_chains, torch_chains.get(allowed)
    # The walker does see torch where it is: the engine imports it at module level.
    assert torch_chains["bulkhead.trainer.engine.world"][-1] == "torch"


def _tree(tmp_path: Path, files: dict[str, str]) -> dict[str, tuple[str, list[Import]]]:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for root in ROOTS:
        (tmp_path / root).mkdir(exist_ok=True)
    modules = {}
    for rel in files:
        path = tmp_path / rel
        parts = Path(rel).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        name = ".".join(("bulkhead", *parts))
        modules[name] = (rel, imports_of(path.read_text(), name, path.name == "__init__.py"))
    return modules


def test_each_broken_rule_is_reported(tmp_path: Path) -> None:
    modules = _tree(
        tmp_path,
        {
            "api/__init__.py": "",
            "api/spec.py": "from bulkhead.trainer.config import X\n",
            "trainer/__init__.py": "",
            "trainer/config.py": "X = 1\n",
            "trainer/heavy.py": "import torch\n",
            "trainer/light.py": "from bulkhead.trainer import heavy\n",
            "trainer/uses_agent.py": "def f():\n    from bulkhead.agent.x import y\n",
            "agent/__init__.py": "",
            "agent/x.py": "y = 1\n",
            "agent/bad.py": "from bulkhead.trainer.light import z\n",
            "operator/__init__.py": "",
            "operator/lifecycle/__init__.py": "",
            "operator/lifecycle/policy.py": "from bulkhead.operator.session import job\n",
            "operator/session/__init__.py": "",
            "operator/session/job.py": "from trainer import config\n",
            "operator/local/__init__.py": "",
            "operator/local/driver.py": "from bulkhead.trainer.config import X\n",
        },
    )
    found = "\n".join(violations(modules))
    assert "api/spec.py:1" in found and "api imports nothing of ours" in found
    assert "trainer/uses_agent.py:2" in found and "nothing imports agent" in found
    assert "agent/bad.py:1" in found and "trainer.light -> bulkhead.trainer.heavy -> torch" in found
    assert "operator/lifecycle/policy.py:1" in found and "lifecycle/ is pure" in found
    assert "operator/session/job.py:1" in found and "not a top-level package" in found
    assert "operator/local/driver.py:1" in found and "the operator imports only" in found
