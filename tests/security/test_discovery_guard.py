"""Service discovery answers on inbox reply subjects only (docs/security.md):
`InboxOnlyService` overrides nats-py's private discovery handlers, so it
starts only on the nats-py whose `Service.start` calls them. On any other,
an override nobody calls would answer `$SRV.PING` on a stream's subject;
the service refuses to start instead, and the bridge relays on without it,
saying why."""

from __future__ import annotations

import json

import anyio
import nats
import nats.aio.msg
import nats.errors
import nats.micro.service
import pytest
import structlog

from bridge.apps.demo.publisher import WirePublisher
from bridge.apps.fleet import ObserveOptions, ObserveService
from bridge.client.connection import settings_for
from bridge.runtime import inbox_service
from bridge.runtime.inbox_service import DISCOVERY_HANDLERS, UnguardedDiscovery, discovery_problem
from bridge.runtime.nats_py import PINNED_NATS_PY, installed_nats_py
from bridge.runtime.nats_server import NatsServerProcess
from tests.busutil import endpoints, make_settings, running_bridge, wait_published
from tests.faults.harness import fault_batch

SUBJECT = "kvbridge.snapshot.kv.test-worker"


class _RenamedHandlers(nats.micro.service.Service):
    """A nats-py whose start wires discovery to handlers of other names."""

    async def start(self) -> None:
        await self._client.subscribe("$SRV.PING", cb=self._on_ping)

    async def _on_ping(self, msg: nats.aio.msg.Msg) -> None:
        await msg.respond(b"{}")


def test_the_pinned_nats_py_is_installed_and_its_discovery_is_guarded() -> None:
    """CI installs the pinned release: the guard is what its tests exercise."""
    assert installed_nats_py() == PINNED_NATS_PY
    assert discovery_problem() is None


def test_another_release_or_handlers_it_no_longer_calls_are_refused() -> None:
    other = discovery_problem("2.99.0")
    assert other is not None and "2.99.0" in other and PINNED_NATS_PY in other
    renamed = discovery_problem(service_type=_RenamedHandlers)
    assert renamed is not None and all(name in renamed for name in DISCOVERY_HANDLERS)


@pytest.mark.anyio
async def test_where_discovery_cannot_be_guarded_the_bridge_relays_without_the_service(
        nats_server: NatsServerProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(inbox_service, "installed_nats_py", lambda: "2.99.0")
    pub_ep, replay_ep = endpoints()
    settings = make_settings(zmq_endpoint=[pub_ep], replay_endpoint=[replay_ep], nats_url=[nats_server.url])
    publisher = WirePublisher(pub_ep.replace("127.0.0.1", "*"), replay_ep.replace("127.0.0.1", "*"))
    nc = await nats.connect(nats_server.url)
    try:
        with structlog.testing.capture_logs() as logs:
            async with running_bridge(settings) as bridge:
                for k in range(3):
                    publisher.publish(fault_batch(0, k))
                await wait_published(bridge, 3)
                assert bridge.snapshots is None
                # nobody answers a snapshot request, nor discovery (on any reply subject)
                for subject in (SUBJECT, "$SRV.PING"):
                    with pytest.raises(nats.errors.NoRespondersError):
                        await nc.request(subject, b"", timeout=5)
                publisher.publish(fault_batch(0, 3))
                await wait_published(bridge, 4)
        failed = [e for e in logs if e["event"] == "snapshot_service_failed"]
        assert failed and failed[0]["error"] == UnguardedDiscovery.__name__ and "2.99.0" in failed[0]["detail"]
    finally:
        publisher.close()
        await nc.close()


@pytest.mark.anyio
async def test_where_discovery_cannot_be_guarded_observe_answers_over_http_only(
        nats_server: NatsServerProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(inbox_service, "installed_nats_py", lambda: "2.99.0")
    service = ObserveService(ObserveOptions(http_host="127.0.0.1", http_port=0, bucket="", bootstrap=None))
    body = json.dumps({"chain": [1, 2, 3]}).encode()
    with structlog.testing.capture_logs() as logs:
        async with anyio.create_task_group() as tg:
            await tg.start(service.run, settings_for(nats_server.url))
            status, _, answer = await service.route("POST", "/v1/prefix", body)
            assert status == 200 and "workers" in json.loads(answer)
            assert service.micro is None
            nc = await nats.connect(nats_server.url)
            try:
                for subject in ("kvobserve.prefix", "$SRV.PING"):
                    with pytest.raises(nats.errors.NoRespondersError):
                        await nc.request(subject, body, timeout=5)
            finally:
                await nc.close()
            tg.cancel_scope.cancel()
    said = [e for e in logs if e["event"] == "nats_service_unavailable"]
    assert said and "2.99.0" in said[0]["reason"] and said[0]["log_level"] == "error"
