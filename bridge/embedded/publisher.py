"""bridge.testing.publisher under the import path that tests not yet moved to it still use."""

from bridge.testing.publisher import END_SEQ, WirePublisher

__all__ = ["END_SEQ", "WirePublisher"]
