"""bridge.testing.workload under the import path that tests not yet moved to it still use."""

from bridge.testing.workload import ATTN, BLOCK_SIZE, MAMBA, WINDOW, WINDOW_TOKENS, HybridWorkload

__all__ = ["ATTN", "BLOCK_SIZE", "MAMBA", "WINDOW", "WINDOW_TOKENS", "HybridWorkload"]
