"""What the contract's messages mean for residency: the rules that turn a
worker's group messages and records into which block hashes it holds, per
group, medium and layer (`index`), the hybrid prefix rule (`prefix`), and the
structure that stores a whole fleet's residency (`fleet`, with its per-worker
faces in `views`). The bridge runs it over what it publishes (to answer
snapshots) and consumers over what they read, so both reach the same view by
the same code (docs/consumers.md, "Index semantics").
"""

from bridge.residency.hashes import as_int, lookup_keys
from bridge.residency.index import Envelope, Interruption, ResidencyIndex
from bridge.residency.prefix import PrefixMatch, window_blocks
from bridge.residency.slots import WorkerKey
from bridge.residency.views import GroupResidency, WorkerView

__all__ = [
    "Envelope", "GroupResidency", "Interruption", "PrefixMatch", "ResidencyIndex", "WorkerKey", "WorkerView",
    "as_int", "lookup_keys", "window_blocks",
]
