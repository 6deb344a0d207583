"""A Mooncake Conductor indexer API client, written from the design doc alone
(kvcache-ai/Mooncake, docs/source/design/conductor/indexer-api-design.md):
the requests are built and the answers read by the doc's field names only,
with urllib and json, knowing nothing of kv-bridge's code. The tests use it
as a router would."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

# The answer's two fields that are not a medium (the doc: "GPU, CPU, DISK ...
# Names are examples; future media can be added").
_NOT_MEDIA = ("longest_matched", "DP")


@dataclass
class InstanceHit:
    """One instance's entry in an answer: tokens, not blocks."""

    longest_matched: int
    media: dict[str, int] = field(default_factory=dict)
    dp: dict[int, int] = field(default_factory=dict)


@dataclass
class Reply:
    status: int
    body: dict[str, Any]

    def hits(self) -> dict[str, dict[str, InstanceHit]]:
        """tenant → instance → hit, read from the doc's response shape."""
        out: dict[str, dict[str, InstanceHit]] = {}
        for tenant, instances in self.body.items():
            out[tenant] = {}
            for instance, fields in instances.items():
                out[tenant][instance] = InstanceHit(
                    longest_matched=int(fields["longest_matched"]),
                    media={k: int(v) for k, v in fields.items() if k not in _NOT_MEDIA},
                    dp={int(rank): int(tokens) for rank, tokens in fields.get("DP", {}).items()})
        return out


class IndexerClient:
    def __init__(self, base_url: str, timeout: float = 10.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout

    def _post(self, path: str, payload: dict[str, Any]) -> Reply:
        req = urllib.request.Request(self.base_url + path, data=json.dumps(payload).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:  # noqa: S310 - the test's server
                return Reply(resp.status, json.loads(resp.read()))
        except urllib.error.HTTPError as exc:
            return Reply(exc.code, json.loads(exc.read() or b"{}"))

    @staticmethod
    def _scope(model: str | None, block_size: int, tenant_id: str | None, instance_id: str | None,
               lora_name: str | None, cache_salt: str | None) -> dict[str, Any]:
        """The doc's optional fields are left out when not given (their defaults apply)."""
        body: dict[str, Any] = {"block_size": block_size}
        for name, value in (("model", model), ("tenant_id", tenant_id), ("instance_id", instance_id),
                            ("lora_name", lora_name), ("cache_salt", cache_salt)):
            if value is not None:
                body[name] = value
        return body

    def query(self, token_ids: list[int], block_size: int, model: str | None, *, tenant_id: str | None = None,
              instance_id: str | None = None, lora_name: str | None = None,
              cache_salt: str | None = None) -> Reply:
        """`POST /query`: cache hits by token ids."""
        body = self._scope(model, block_size, tenant_id, instance_id, lora_name, cache_salt)
        body["token_ids"] = token_ids
        return self._post("/query", body)

    def query_by_hash(self, seq_hashes: list[int], block_size: int, model: str | None, *,
                      tenant_id: str | None = None, instance_id: str | None = None, lora_name: str | None = None,
                      legacy_name: bool = False) -> Reply:
        """`POST /query_by_hash`: cache hits by rolling sequence hashes
        (`block_hash`, the earlier drafts' name, with `legacy_name`)."""
        body = self._scope(model, block_size, tenant_id, instance_id, lora_name, None)
        body["block_hash" if legacy_name else "seq_hashes"] = seq_hashes
        return self._post("/query_by_hash", body)

    def register(self, endpoint: str, model: str, instance_id: str, block_size: int, dp_rank: int = 0) -> Reply:
        """`POST /register`, with the doc's required fields."""
        return self._post("/register", {"endpoint": endpoint, "type": "vLLM", "modelname": model,
                                         "instance_id": instance_id, "block_size": block_size, "dp_rank": dp_rank})

    def unregister(self, model: str, instance_id: str, block_size: int, dp_rank: int = 0) -> Reply:
        return self._post("/unregister", {"type": "vLLM", "modelname": model, "instance_id": instance_id,
                                           "block_size": block_size, "dp_rank": dp_rank})
