"""`--nats-inbox-prefix`: each NATS user reads replies on a prefix of its
own (docs/security.md, the trust model). A bridge's default is the one its
generated user may read; the tools' is `_INBOX`; anything else must stay
under `_INBOX.` (the bridges answer only there) and hold no wildcard."""

from __future__ import annotations

import pytest

from bridge.apps.permissions import Layout, bridge_role
from bridge.client import settings_for
from bridge.runtime.access import ConfigError, connect_options
from tests.busutil import make_settings


async def _noop() -> None:
    return None


async def _noop_error(exc: Exception) -> None:
    return None


def _prefix(access: object) -> str:
    return str(connect_options(access, "t", _noop, _noop, _noop_error)["inbox_prefix"])  # type: ignore[arg-type]


def test_a_bridge_reads_replies_where_its_generated_user_may() -> None:
    for worker, ranks in (("pod-0", 1), ("pod.a b*>", 1), ("w-dp3", 2)):
        settings = make_settings(worker_id=worker)
        role = bridge_role(worker, Layout(ranks=ranks))
        assert _prefix(settings) == role.inbox_prefix
        assert f"{role.inbox_prefix}.>" in role.subscribe


def test_the_tools_default_and_a_chosen_prefix() -> None:
    assert _prefix(settings_for("nats://127.0.0.1:4222", environ={})) == "_INBOX"
    chosen = settings_for("nats://127.0.0.1:4222", environ={"KVB_NATS_INBOX_PREFIX": "_INBOX.reader"})
    assert _prefix(chosen) == "_INBOX.reader"


@pytest.mark.parametrize("bad", ["MY.inbox", "_INBOX.*", "_INBOX.>", "_INBOX..x", "_INBOXES", "_INBOX.a b"])
def test_a_prefix_outside_inboxes_or_with_wildcards_is_refused(bad: str) -> None:
    with pytest.raises(ConfigError) as err:
        settings_for("nats://127.0.0.1:4222", nats_inbox_prefix=bad, environ={})
    assert err.value.option == "--nats-inbox-prefix"
