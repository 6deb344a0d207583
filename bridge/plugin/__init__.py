"""vLLM general plugin: self-describing offload events for Mamba state groups.

vLLM loads `register` (entry point group `vllm.general_plugins`, name
`kv_bridge_mamba_events`) in every process it starts. It patches the
offloading connector's event tracker so a Mamba group's offloaded chunk is
announced at its one reusable hash instead of as a placeholder. See
docs/plugin.md.
"""

from __future__ import annotations

import contextlib
import os

from . import compat, patch
from .log import get_logger

KILL_SWITCH_ENV = "KVB_PLUGIN_DISABLE"

_unsupported_warned = False
_stood_down = False


def _disabled() -> bool:
    return os.environ.get(KILL_SWITCH_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


def _warn_unsupported(reason: str) -> None:
    # vLLM calls register() in every process and some processes more than
    # once; one warning per process is enough to be seen.
    global _unsupported_warned
    if _unsupported_warned:
        return
    _unsupported_warned = True
    get_logger().warning(
        "kv-bridge plugin: NOT patching vLLM, Mamba offload events stay placeholders: %s",
        reason,
    )


def _stand_down(version: str, how: str) -> None:
    # Once per process, like the warning: register() may run more than once.
    global _stood_down
    if _stood_down:
        return
    _stood_down = True
    get_logger().info(
        "kv-bridge plugin: vLLM %s describes Mamba offload events itself (%s); "
        "standing down, vLLM left untouched",
        version,
        how,
    )


def register() -> None:
    """Patch vLLM's offloading event tracker once; never raise."""
    try:
        _register()
    except Exception as exc:  # a plugin must never take vLLM down
        with contextlib.suppress(Exception):
            _warn_unsupported(f"unexpected error {exc!r}")


def _register() -> None:
    logger = get_logger()
    if _disabled():
        logger.info("kv-bridge plugin: disabled by %s, vLLM left untouched", KILL_SWITCH_ENV)
        return
    if patch.is_patched():
        logger.debug("kv-bridge plugin: already patched in this process")
        return

    native = compat.native_support()
    if native is not None:
        _stand_down(compat.vllm_version(), native)
        return

    try:
        layout = compat.detect()
    except compat.UnsupportedVllm as exc:
        _warn_unsupported(str(exc))
        return

    if patch.apply(layout):
        logger.info(
            "kv-bridge plugin: patched vLLM %s %s.{%s} (pid %d): MambaSpec "
            "groups now announce offloaded state checkpoints at one hash with "
            "kind 'mamba'; attention and sliding-window events unchanged",
            layout.vllm_version,
            layout.tracker_cls.__name__,
            ",".join(layout.methods),
            os.getpid(),
        )
    else:
        logger.debug("kv-bridge plugin: already patched in this process")
