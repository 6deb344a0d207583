"""Which tests start another process, read from their code at collection.

A test is process-level when its function, one of its fixtures, or anything
of `tests`, `bridge` or `bench` they call (functions, classes' methods, followed
through module globals) names a way to start a process: the `subprocess`,
`multiprocessing` or `asyncio.subprocess` modules, or `Popen`,
`open_process`, `run_process`, `create_subprocess_exec`/`_shell`. That covers
a nats-server (`NatsServerProcess`, a cluster), a bridge or vLLM engine
subprocess, and outside tools (helm, docker, openssl, ruff, mkdocs), with no
mark written by hand on any test. The reading is of names, not of paths
taken: a test that only may start a process counts as one.

`vllm` tests import vLLM (the plugin, its release folders): they live under
`tests/plugin/`, `tests/engine/` or `tests/compat/`, or use their fixtures.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable, Iterable
from typing import Any

_STARTER_MODULES = frozenset({"subprocess", "multiprocessing", "asyncio.subprocess"})
_STARTER_NAMES = frozenset({"Popen", "open_process", "run_process", "create_subprocess_exec",
                            "create_subprocess_shell"})
_FOLLOWED = ("tests", "bridge", "bench")
VLLM_DIRS = frozenset({"plugin", "engine", "compat"})
# What every way of running a nats-server goes through.
NATS_SERVER = frozenset({"find_nats_server"})


def _codes(code: types.CodeType) -> Iterable[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def _followed(obj: Any) -> bool:
    module = getattr(obj, "__module__", None) or ""
    return module.split(".", 1)[0] in _FOLLOWED


class ProcessReader:
    """Answers "does this callable start a process?" (or, given other
    `modules` and `names`, "does it reach one of these?"), remembering every
    function it has read (the suite shares helpers)."""

    def __init__(self, modules: frozenset[str] = _STARTER_MODULES, names: frozenset[str] = _STARTER_NAMES) -> None:
        self._modules = modules
        self._names = names
        self._known: dict[int, bool] = {}

    def starts(self, obj: Any) -> bool:
        return self._reads(obj, set())

    def _reads(self, obj: Any, seen: set[int]) -> bool:
        try:
            obj = inspect.unwrap(obj) if callable(obj) else obj
        except ValueError:  # a __wrapped__ chain with no end (a mock)
            return False
        if isinstance(obj, types.ModuleType):
            return obj.__name__ in self._modules
        if getattr(obj, "__name__", None) in self._names:
            return True
        if id(obj) in self._known:
            return self._known[id(obj)]
        if id(obj) in seen or not _followed(obj):
            return False
        seen.add(id(obj))
        if isinstance(obj, type):
            found = any(self._reads(v, seen) for v in vars(obj).values()
                        if isinstance(v, (types.FunctionType, staticmethod, classmethod, property)))
        elif isinstance(obj, (staticmethod, classmethod)):
            found = self._reads(obj.__func__, seen)
        elif isinstance(obj, property):
            found = any(self._reads(f, seen) for f in (obj.fget, obj.fset) if f is not None)
        elif isinstance(obj, types.FunctionType):
            found = self._function(obj, seen)
        else:
            found = False
        self._known[id(obj)] = found
        return found

    def _function(self, fn: types.FunctionType, seen: set[int]) -> bool:
        names: set[str] = set()
        for code in _codes(fn.__code__):
            names.update(code.co_names)
        if names & self._names:
            return True
        scope = fn.__globals__
        cells = [c.cell_contents for c in fn.__closure__ or () if _filled(c)]
        return any(self._reads(scope[n], seen) for n in names if n in scope) or any(
            self._reads(v, seen) for v in cells)


def _filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


def fixture_functions(item: Any, unread: frozenset[str] = frozenset()) -> Iterable[Callable[..., Any]]:
    """The functions behind every fixture `item` uses, its own conftests'
    included, but those named in `unread`."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return
    for name, defs in info.name2fixturedefs.items():
        if name not in unread:
            for d in defs:
                yield d.func
