"""The package layout's import rules, read from the source with ast.

The folder list shows both sides of the bus (docs/index.md draws it):

- `bridge.contract` is a leaf: it imports nothing of `bridge` outside itself.
- `bridge.residency` (the rules of residency and the fleet index) imports only
  the contract; `bridge.runtime` (access, a local nats-server, logging,
  stopping) likewise.
- `bridge.producer` (the bridge) never imports the client or the apps.
- `bridge.client` (the consumers' API) never imports the producer or the apps.
- `bridge.plugin` runs inside vLLM and imports nothing else of `bridge`.

Every import counts, at module level or inside a function or a TYPE_CHECKING block.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).parent.parent
BRIDGE = ROOT / "bridge"

RESIDENCY_ALLOWED = ("bridge.contract", "bridge.residency")
RUNTIME_ALLOWED = ("bridge.contract", "bridge.runtime")
PRODUCER_ALLOWED = ("bridge.contract", "bridge.residency", "bridge.runtime", "bridge.producer")
CONSUMER_ALLOWED = ("bridge.contract", "bridge.residency", "bridge.runtime", "bridge.client")
# The package root holds only the distribution's version, which a tool may print.
ROOT_VERSION = ("bridge", "bridge.__version__")


def _module_of(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, module: str) -> Iterator[tuple[int, str]]:
    """(line, absolute module) for every import in `path`, the source of
    `module`; `from pkg import name` also yields `pkg.name`, which names a
    submodule when `name` is one."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            yield node.lineno, target
            for alias in node.names:
                yield node.lineno, f"{target}.{alias.name}"


def _within(module: str, packages: tuple[str, ...], exact: tuple[str, ...] = ()) -> bool:
    return module in exact or any(module == p or module.startswith(p + ".") for p in packages)


def _is_bridge(module: str) -> bool:
    return module == "bridge" or module.startswith("bridge.")


def _violations(sources: dict[str, Path], allowed: tuple[str, ...], exact: tuple[str, ...] = ()) -> list[str]:
    """`module:line: imported` for each import of `bridge` outside the packages
    `allowed` and the modules `exact`; `sources` maps module names to their files."""
    found = []
    for name, path in sources.items():
        for line, module in _imports(path, name):
            if _is_bridge(module) and not _within(module, allowed, exact):
                found.append(f"{name}:{line}: {module}")
    return sorted(set(found))


def _sources(*where: str) -> dict[str, Path]:
    paths: list[Path] = []
    for name in where:
        target = BRIDGE / name
        paths.extend(sorted(target.rglob("*.py")) if target.is_dir() else [target])
    assert paths, where
    return {_module_of(path): path for path in paths}


def test_contract_imports_nothing_of_the_bridge() -> None:
    found = _violations(_sources("contract"), ("bridge.contract",))
    assert not found, "bridge.contract must be a leaf:\n" + "\n".join(found)


def test_residency_imports_only_the_contract() -> None:
    found = _violations(_sources("residency"), RESIDENCY_ALLOWED)
    assert not found, "bridge.residency may import only " + ", ".join(RESIDENCY_ALLOWED) + ":\n" + "\n".join(found)


def test_runtime_imports_only_the_contract() -> None:
    found = _violations(_sources("runtime"), RUNTIME_ALLOWED)
    assert not found, "bridge.runtime may import only " + ", ".join(RUNTIME_ALLOWED) + ":\n" + "\n".join(found)


def test_producer_imports_no_client_or_app() -> None:
    found = _violations(_sources("producer"), PRODUCER_ALLOWED, ROOT_VERSION)
    assert not found, "the producer may import only " + ", ".join(PRODUCER_ALLOWED) + ":\n" + "\n".join(found)


def test_consumers_import_no_producer_module() -> None:
    found = _violations(_sources("client"), CONSUMER_ALLOWED, ROOT_VERSION)
    assert not found, "consumers may import only " + ", ".join(CONSUMER_ALLOWED) + ":\n" + "\n".join(found)


def test_the_plugin_imports_nothing_else_of_the_bridge() -> None:
    found = _violations(_sources("plugin"), ("bridge.plugin",))
    assert not found, "bridge.plugin runs inside vLLM:\n" + "\n".join(found)


def test_the_top_level_is_the_layout() -> None:
    """The folder list is the drawing: every package of `bridge` is one of the
    sides, and nothing else sits beside them but the entry point."""
    packages = {p.name for p in BRIDGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    modules = {p.name for p in BRIDGE.glob("*.py")}
    assert packages == {"contract", "residency", "runtime", "producer", "client", "apps", "plugin"}, packages
    assert modules == {"__init__.py", "__main__.py", "cli.py"}, modules


def test_the_rules_see_a_violation(tmp_path: Path) -> None:
    """The check itself: a producer import, plain, relative or in a function, is caught."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from bridge.contract import GroupMessage\n"
        "from bridge import __version__\n"
        "from bridge.producer import config\n"
        "from bridge.producer.sink.queue import OutBatch\n"
        "from ..producer.normalize import kinds\n"
        "def f():\n"
        "    import bridge.producer.service\n",
        encoding="utf-8",
    )
    found = _violations({"bridge.client.probe": probe}, CONSUMER_ALLOWED, ROOT_VERSION)
    modules = {entry.rpartition(": ")[2] for entry in found}
    expected = {"bridge.producer.sink.queue", "bridge.producer.normalize", "bridge.producer.service", "bridge.producer.config"}
    assert expected <= modules, found
    assert not any(m.startswith("bridge.contract") or m.endswith("__version__") for m in modules), found
