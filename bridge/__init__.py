"""kv-bridge: vLLM KV-cache events, hybrid-aware, on NATS."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__: str = version("kv-bridge")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+source"
