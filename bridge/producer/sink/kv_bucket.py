"""The key-value buckets the bridge makes (the worker registry, the snapshot
bucket), made so that no publish a permission list allows can touch another
writer's keys.

A NATS permission sees subjects, not headers. A bucket made by nats-py's
`create_key_value` honours `Nats-Rollup`, so one put on a key a user may
write, with `Nats-Rollup: all`, would purge every key of the bucket. The
bridge therefore makes its buckets itself: rollup headers and message deletes
refused (a purge of the whole bucket is an API call, which a permission list
does see and only an admin is given). A writer can still put a delete marker
(`KV-Operation: DEL`, a plain message) on its own keys, which is all the
bridge needs. A bucket that exists already is the operator's: it is used as
it is, and one that honours rollups is named in a warning."""

from __future__ import annotations

import nats.js
import nats.js.api
import nats.js.errors
import structlog
from nats.js.kv import KeyValue

log = structlog.get_logger("bridge.kv_bucket")


def bucket_config(bucket: str, *, history: int, ttl: float, replicas: int, description: str,
                  direct: bool = True) -> nats.js.api.StreamConfig:
    """The bucket's stream: what nats-py's `create_key_value` makes, without
    rollups."""
    return nats.js.api.StreamConfig(
        name=f"KV_{bucket}",
        description=description,
        subjects=[f"$KV.{bucket}.>"],
        allow_direct=direct,
        allow_rollup_hdrs=False,
        deny_delete=True,
        discard=nats.js.api.DiscardPolicy.NEW,
        duplicate_window=min(120.0, ttl) if ttl else 120.0,
        max_age=ttl or None,
        max_msgs_per_subject=history,
        num_replicas=replicas,
        storage=nats.js.api.StorageType.FILE,
    )


async def open_bucket(js: nats.js.JetStreamContext, bucket: str, *, history: int, ttl: float, replicas: int,
                      description: str) -> KeyValue:
    """The bucket, made as `bucket_config` says when missing."""
    try:
        kv = await js.key_value(bucket)
    except nats.js.errors.BucketNotFoundError:
        try:
            await js.add_stream(bucket_config(bucket, history=history, ttl=ttl, replicas=replicas,
                                              description=description))
        except nats.js.errors.BadRequestError:
            pass  # made by another bridge meanwhile
        return await js.key_value(bucket)
    await warn_if_unguarded(js, f"KV_{bucket}")
    return kv


async def warn_if_unguarded(js: nats.js.JetStreamContext, stream: str) -> None:
    """`warn_unguarded` for a stream looked up by name."""
    try:
        info = await js.stream_info(stream)
    except Exception as exc:  # a user may be allowed to use a stream without reading its info
        log.debug("stream_info_unavailable", stream=stream, error=type(exc).__name__)
        return
    warn_unguarded(stream, info.config)


def warn_unguarded(stream: str, config: nats.js.api.StreamConfig) -> None:
    """An existing stream that honours rollup headers lets any writer of one
    of its subjects purge all of it: said once, at start."""
    if config.allow_rollup_hdrs:
        log.warning("stream_allows_rollup", stream=stream,
                    hint="any writer of one of its subjects can purge all of it with a Nats-Rollup header; "
                         "set allow_rollup_hdrs false (nats stream edit) or let the bridge make it")
