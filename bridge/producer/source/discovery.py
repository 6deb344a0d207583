"""What vLLM says it publishes: `GET <vllm-url>/kv_event_sources`.

vLLM 0.31.0 and later serve there the resolved `KVEventsConfig` of each
data-parallel rank (ports bound as 0 already resolved). A sidecar shares the
pod's network, so an endpoint vLLM bound on every interface (`tcp://*:N`) is
reached on the pod's loopback.
"""

from __future__ import annotations

import enum
import urllib.error
import urllib.request
from typing import Final

import anyio
import msgspec
import structlog

log = structlog.get_logger("bridge.producer.discovery")

ROUTE: Final = "/kv_event_sources"
# Far above any fleet's answer (a few hundred bytes a rank), so a wrong URL
# that streams something large costs nothing.
MAX_BODY: Final = 1024 * 1024
# Hosts that mean "every interface" when vLLM binds; the sidecar connects to
# the same pod's loopback instead.
_ANY_HOST: Final = frozenset({"*", "0.0.0.0", "::", "[::]"})


class EventsConfig(msgspec.Struct):
    """vLLM's KVEventsConfig, the fields a subscriber needs; the rest is ignored."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = ""
    replay_endpoint: str | None = None
    topic: str = ""


class Source(msgspec.Struct, frozen=True):
    """One rank's publisher, as the bridge connects to it."""

    dp_rank: int
    endpoint: str
    replay_endpoint: str | None
    topic: str


class Skipped(enum.Enum):
    """Why a rank vLLM lists is not subscribed to."""

    DISABLED = "events_disabled"
    NOT_ZMQ = "publisher_not_zmq"
    UNRESOLVED = "endpoint_unresolved"


class RouteMissing(Exception):
    """The server answered 404: a vLLM older than 0.31.0, or not vLLM."""


class DiscoveryError(Exception):
    """An answer that is not vLLM's, or ranks the bridge cannot serve together."""


def local_endpoint(endpoint: str) -> str | None:
    """Where the sidecar connects for an endpoint vLLM bound: every-interface
    hosts become the loopback; None for a tcp endpoint whose port is not
    resolved (0) or not a number."""
    if not endpoint.startswith("tcp://"):
        return endpoint if endpoint.startswith(("ipc://", "inproc://")) else None
    host, sep, port = endpoint[len("tcp://"):].rpartition(":")
    if not sep or not port.isdigit() or int(port) == 0 or int(port) > 65535:
        return None
    if host in _ANY_HOST:
        host = "127.0.0.1"
    return f"tcp://{host}:{port}"


def parse_sources(body: bytes) -> tuple[list[Source], dict[int, Skipped]]:
    """The ranks to subscribe to, in rank order, and the ranks left out with why."""
    try:
        answer = msgspec.json.decode(body, type=dict[str, EventsConfig])
    except msgspec.DecodeError as exc:
        raise DiscoveryError(f"not vLLM's answer: {exc}") from None
    sources: list[Source] = []
    skipped: dict[int, Skipped] = {}
    for key, cfg in answer.items():
        if not key.isdigit() or int(key) > 1023:
            raise DiscoveryError(f"not a data-parallel rank: {key[:40]!r}")
        rank = int(key)
        if not cfg.enable_kv_cache_events:
            skipped[rank] = Skipped.DISABLED
            continue
        if cfg.publisher != "zmq":
            skipped[rank] = Skipped.NOT_ZMQ
            continue
        endpoint = local_endpoint(cfg.endpoint)
        replay = local_endpoint(cfg.replay_endpoint) if cfg.replay_endpoint else None
        if endpoint is None or (cfg.replay_endpoint and replay is None):
            skipped[rank] = Skipped.UNRESOLVED
            continue
        sources.append(Source(rank, endpoint, replay, cfg.topic))
    sources.sort(key=lambda s: s.dp_rank)
    if len({s.topic for s in sources}) > 1:
        raise DiscoveryError("ranks publish under different topics: " + ", ".join(sorted({s.topic for s in sources})))
    return sources, skipped


def fetch(url: str, timeout: float, route: str = ROUTE) -> bytes:
    """The route's body; RouteMissing on 404, OSError when vLLM is not up."""
    target = url.rstrip("/") + route
    try:
        with urllib.request.urlopen(target, timeout=timeout) as resp:  # noqa: S310 - the operator's URL
            body: bytes = resp.read(MAX_BODY + 1)
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            raise RouteMissing(target) from None
        raise OSError(f"{target} answered {exc.code}") from None
    if len(body) > MAX_BODY:
        raise DiscoveryError(f"{target} answered more than {MAX_BODY} bytes")
    return body


async def read_sources(url: str, timeout: float = 5.0) -> tuple[list[Source], dict[int, Skipped]]:
    body = await anyio.to_thread.run_sync(fetch, url, timeout, abandon_on_cancel=True)
    return parse_sources(body)


async def wait_for_sources(url: str, poll: float) -> list[Source]:
    """Ask until vLLM lists at least one rank the bridge can subscribe to: it
    may still be loading its model. RouteMissing is final."""
    said: object = None
    while True:
        try:
            sources, skipped = await read_sources(url)
        except (OSError, DiscoveryError) as exc:
            why: object = f"{type(exc).__name__}: {exc}"
            sources, skipped = [], {}
        else:
            why = {rank: s.value for rank, s in skipped.items()} or "no ranks listed yet"
        if sources:
            for rank, reason in skipped.items():
                log.warning("vllm_rank_skipped", url=url, dp_rank=rank, reason=reason.value)
            log.info("vllm_sources", url=url, sources=[msgspec.to_builtins(s) for s in sources])
            return sources
        if why != said:
            log.info("vllm_waiting", url=url, why=why)
            said = why
        await anyio.sleep(poll)
