"""The consumers' Python API: read the kv-bridge NATS contract, keep a
hybrid-aware residency index, ask it where a request's prefix is cached.

::

    conn = BusConnection()
    await conn.open(settings_for("nats://127.0.0.1:4222"), "my-router")
    index = ResidencyIndex()
    async with BusSubscriber(conn, "kv.>") as sub:
        async for item in sub:
            index.apply(item)   # and index.longest_prefix(chain) when a request comes

docs/consumers.md has a complete example and the semantics in full.
"""

from bridge.client.bootstrap import BootstrapOptions, SnapshotSource
from bridge.client.chain import ChainHasher, request_chain
from bridge.client.codec import BusCodec, BusDecodeError
from bridge.client.connection import DEFAULT_URL, BusConnection, access_settings, add_access_arguments, settings_for
from bridge.client.registry import RegistryFollower, declare_entry
from bridge.client.subscribe import BusItem, BusMessage, BusSubscriber, Interruption, StartAt, parse_since
from bridge.contract import GroupMessage, WorkerEntry, WorkerRecord, liveness
from bridge.contract.snapshot import RankSnapshot, SnapshotMissing
from bridge.residency.hashes import as_int, lookup_keys
from bridge.residency.index import ResidencyIndex
from bridge.residency.prefix import PrefixMatch, window_blocks
from bridge.residency.views import GroupResidency, WorkerKey, WorkerView

__all__ = [
    "DEFAULT_URL",
    "BootstrapOptions",
    "BusCodec",
    "BusConnection",
    "BusDecodeError",
    "BusItem",
    "BusMessage",
    "BusSubscriber",
    "ChainHasher",
    "GroupMessage",
    "GroupResidency",
    "Interruption",
    "PrefixMatch",
    "RankSnapshot",
    "RegistryFollower",
    "ResidencyIndex",
    "SnapshotMissing",
    "SnapshotSource",
    "StartAt",
    "WorkerEntry",
    "WorkerKey",
    "WorkerRecord",
    "WorkerView",
    "access_settings",
    "add_access_arguments",
    "as_int",
    "declare_entry",
    "liveness",
    "lookup_keys",
    "parse_since",
    "request_chain",
    "settings_for",
    "window_blocks",
]
