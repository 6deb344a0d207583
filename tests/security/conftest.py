"""Security fixtures: one PKI per session (openssl CLI)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from bridge.runtime.nats_server import nats_server_available
from tests.security.secure_nats import Pki, make_pki

if not nats_server_available():  # pragma: no cover - the CI image has it
    pytest.skip("nats-server binary not available", allow_module_level=True)


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl CLI makes the test certificates")
    return make_pki(Path(tmp_path_factory.mktemp("pki")))
