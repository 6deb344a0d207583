"""The NATS contract: everything the bridge and its consumers must agree on.

A leaf package: it imports nothing else of `bridge`, so the bridge (producer)
and the consumers (`bridge.client`, `bridge.apps`) both import it and neither
imports the other. One module per part of the agreement:

- `events`: vLLM's KV event structs, as relayed
- `messages`: the group messages and worker records, and their headers
- `kinds`: kinds, families and the residency rules both sides apply
- `subjects`: subject names, worker-token escaping, the stream's name
- `msgid`: the `Nats-Msg-Id` scheme
- `registry`: the worker registry's entries and liveness
- `codec`: the payload formats and their codecs
"""

from bridge.contract.codec import DEFAULT_FORMAT, FORMATS, decoder_for, encoder_for
from bridge.contract.events import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, Event, KVEventBatch, hash_hex
from bridge.contract.kinds import (
    ATTENTION,
    FAMILIES,
    FAMILY_OF_KIND,
    GPU_MEDIUM,
    LEGACY_KIND,
    MAX_GROUP_ID,
    OTHER,
    STATE,
    UNKNOWN_KIND,
    WINDOW,
    clean_kind,
    family_of,
    parse_group_kind,
    state_checkpoints,
)
from bridge.contract.messages import (
    HDR_EPOCH,
    HDR_FAMILY,
    HDR_FORMAT,
    HDR_KIND,
    HDR_MSG_ID,
    HDR_RECORD,
    HDR_SEQ,
    SCHEMA_VERSION,
    GroupEvent,
    GroupMessage,
    KindSource,
    RecordType,
    WorkerRecord,
)
from bridge.contract.registry import (
    DEFAULT_BUCKET,
    DEFAULT_DEAD_AFTER,
    DEFAULT_TENANT,
    REGISTRY_VERSION,
    GroupInfo,
    Liveness,
    RankInfo,
    WorkerEntry,
    decode_entry,
    encode_entry,
    liveness,
    registry_key,
)
from bridge.contract.subjects import (
    DEFAULT_STREAM,
    MAX_WORKER_ID_BYTES,
    WORKER_TOKEN,
    escape_token,
    parse_worker_token,
    unescape_token,
    validate_prefix,
    validate_worker_id,
    worker_token,
)

__all__ = [
    "ATTENTION", "DEFAULT_BUCKET", "DEFAULT_DEAD_AFTER", "DEFAULT_FORMAT", "DEFAULT_TENANT", "DEFAULT_STREAM", "FAMILIES",
    "FAMILY_OF_KIND", "FORMATS", "GPU_MEDIUM", "HDR_EPOCH", "HDR_FAMILY", "HDR_FORMAT", "HDR_KIND", "HDR_MSG_ID",
    "HDR_RECORD", "HDR_SEQ", "LEGACY_KIND", "MAX_GROUP_ID", "MAX_WORKER_ID_BYTES", "OTHER", "REGISTRY_VERSION",
    "SCHEMA_VERSION", "STATE", "UNKNOWN_KIND", "WINDOW", "WORKER_TOKEN", "AllBlocksCleared", "BlockHash",
    "BlockRemoved", "BlockStored", "Event", "GroupEvent", "GroupInfo", "GroupMessage", "KVEventBatch", "KindSource",
    "Liveness", "RankInfo", "RecordType", "WorkerEntry", "WorkerRecord", "clean_kind", "decode_entry",
    "decoder_for", "encode_entry", "encoder_for", "escape_token", "family_of", "hash_hex", "liveness",
    "parse_group_kind", "parse_worker_token", "registry_key", "state_checkpoints", "unescape_token",
    "validate_prefix", "validate_worker_id", "worker_token",
]
