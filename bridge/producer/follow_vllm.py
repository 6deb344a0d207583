"""`kv-bridge run --vllm-url`: the bridge run on the publishers vLLM lists.

It waits for vLLM to list them, runs the bridge on them, and reads the list
again every poll interval. A vLLM restarted on the same endpoints needs
nothing (the subscribers reconnect and the restart is seen by its seq); one
that lists other endpoints (ports bound as 0, a new rank count) ends the
bridge's run, as a SIGTERM would (drained, stop records published), and
starts it again on the new list.

Without `--model`, the worker's model is the one vLLM serves: the first base
model (no `parent`) its OpenAI-compatible `GET /v1/models` lists, read at
each start of the bridge's run.
"""

from __future__ import annotations

import anyio
import msgspec
import structlog

from bridge.producer.config import Settings
from bridge.producer.service import Bridge
from bridge.producer.source.discovery import (
    DiscoveryError,
    RouteMissing,
    Source,
    fetch,
    read_sources,
    wait_for_sources,
)
from bridge.runtime.stopping import stop_on_signal

log = structlog.get_logger("bridge.producer.follow_vllm")

# Exit status when the URL answers but has no /kv_event_sources: a
# configuration error, like a bad flag (argparse's status).
EXIT_NO_ROUTE = 2


MODELS_ROUTE = "/v1/models"


class _Model(msgspec.Struct):
    id: str
    parent: str | None = None  # set for a LoRA adapter vLLM serves beside its base model


class _Models(msgspec.Struct):
    data: list[_Model] = []


def parse_models(body: bytes) -> str:
    """The model an OpenAI-compatible `/v1/models` answer names: its first
    base model, else its first entry; '' for none. DiscoveryError when the
    answer is not one."""
    try:
        models = msgspec.json.decode(body, type=_Models).data
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise DiscoveryError(f"not an OpenAI /v1/models answer: {exc}") from None
    base = [m.id for m in models if m.parent is None]
    return (base or [m.id for m in models] or [""])[0]


async def served_model(url: str, timeout: float = 5.0) -> str:
    """The model vLLM at `url` serves ('' when it does not say: logged)."""
    try:
        body = await anyio.to_thread.run_sync(fetch, url, timeout, MODELS_ROUTE, abandon_on_cancel=True)
        model = parse_models(body)
    except (OSError, DiscoveryError, RouteMissing) as exc:
        log.warning("vllm_model_unknown", url=url, error=f"{type(exc).__name__}: {exc}",
                    hint="give --model so consumers can tell this worker's model")
        return ""
    log.info("vllm_model", url=url, model=model)
    return model


class _Round:
    """How one run of the bridge ended."""

    def __init__(self) -> None:
        self.changed = False
        self.rc = 0


async def _watch(settings: Settings, running: list[Source], stop: anyio.Event, end_run: anyio.Event,
                 round_: _Round) -> None:
    """Ends the run (`end_run`) when vLLM lists other publishers than
    `running` (`round_.changed`), or once `stop` is set."""
    async with anyio.create_task_group() as tg:

        async def poll() -> None:
            while True:
                await anyio.sleep(settings.vllm_poll_interval)
                try:
                    sources, _ = await read_sources(settings.vllm_url)
                except (OSError, DiscoveryError, RouteMissing):
                    continue  # vLLM restarting: the subscribers wait for it on their own
                if sources and sources != running:
                    log.info("vllm_sources_changed", url=settings.vllm_url,
                             sources=[msgspec.to_builtins(s) for s in sources])
                    round_.changed = True
                    tg.cancel_scope.cancel()

        async def stopped() -> None:
            await stop.wait()
            tg.cancel_scope.cancel()

        tg.start_soon(poll)
        tg.start_soon(stopped)
    end_run.set()


async def _sources_or_stop(settings: Settings, stop: anyio.Event) -> list[Source] | RouteMissing | None:
    """vLLM's publishers once it lists some; RouteMissing when it never will;
    None when stopped first."""
    found: list[Source] | RouteMissing | None = None
    async with anyio.create_task_group() as tg:

        async def wait() -> None:
            nonlocal found
            try:
                found = await wait_for_sources(settings.vllm_url, settings.vllm_poll_interval)
            except RouteMissing as exc:
                found = exc
            tg.cancel_scope.cancel()

        async def stopped() -> None:
            await stop.wait()
            tg.cancel_scope.cancel()

        tg.start_soon(wait)
        tg.start_soon(stopped)
    return found


async def follow(settings: Settings, *, handle_signals: bool = True) -> int:
    """Run the bridge on vLLM's listed publishers until stopped."""
    stop = anyio.Event()
    rc = 0
    async with anyio.create_task_group() as tg:
        if handle_signals:
            tg.start_soon(stop_on_signal, stop)
        while True:
            sources = await _sources_or_stop(settings, stop)
            if isinstance(sources, RouteMissing):
                log.error("vllm_no_event_sources", url=str(sources),
                          hint="this vLLM has no /kv_event_sources (it came with vLLM 0.31.0): run with "
                               "--zmq-endpoint, --replay-endpoint, --dp-ranks and --topic instead")
                rc = EXIT_NO_ROUTE
            if not isinstance(sources, list):
                break
            model = settings.model or await served_model(settings.vllm_url)
            planned = msgspec.structs.replace(settings, sources=sources, topic=sources[0].topic, model=model)
            end_run = anyio.Event()
            round_ = _Round()
            async with anyio.create_task_group() as run:
                run.start_soon(_watch, settings, sources, stop, end_run, round_)
                rc = await Bridge(planned).run(stop=end_run)
                run.cancel_scope.cancel()
            if not round_.changed:
                break
        tg.cancel_scope.cancel()
    return rc
