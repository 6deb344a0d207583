"""`CatalogQueue`, the service's queue that shows every batch to the group
catalog on its way in; the registry itself is split by side: entries and
liveness in bridge.contract.registry, the writer in bridge.sink.registry_writer,
the catalog in bridge.sink.catalog."""

from __future__ import annotations

from typing import Any

from bridge.contract import WorkerEntry
from bridge.sink.catalog import GroupCatalog
from bridge.sink.queue import BatchQueue, OutBatch
from bridge.sink.registry_writer import WorkerRegistry, ttl_for

# Names still imported from here by modules not yet moved to their new homes.
__all__ = ["CatalogQueue", "GroupCatalog", "WorkerEntry", "WorkerRegistry", "ttl_for"]


class CatalogQueue(BatchQueue):
    """The bridge's BatchQueue, showing every batch to a GroupCatalog on its way
    in: every pipeline already writes through it, so nothing else changes.
    Arguments after `catalog` are BatchQueue's own."""

    def __init__(self, catalog: GroupCatalog, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.catalog = catalog

    def put(self, batch: OutBatch) -> None:
        self.catalog.observe(batch)
        super().put(batch)
