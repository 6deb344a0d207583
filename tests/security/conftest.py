"""Security fixtures: one PKI per session (openssl CLI)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.security.secure_nats import Pki, make_pki


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl CLI makes the test certificates")
    return make_pki(Path(tmp_path_factory.mktemp("pki")))
