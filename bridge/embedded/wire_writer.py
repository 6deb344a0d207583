"""bridge.testing.wire_writer under the import path that tests not yet moved to it still use."""

from bridge.testing.wire_writer import cleared, encode_batch, removed, stored

__all__ = ["cleared", "encode_batch", "removed", "stored"]
