from pathlib import Path

import pytest

from bridge.producer.config import OPTIONS, ConfigError, options_table
from tests.busutil import make_settings


def test_flag_wins_over_environment_and_env_lists_split_on_commas() -> None:
    import argparse

    from bridge.producer.config import load_settings

    ns = argparse.Namespace(**{o.dest: None for o in OPTIONS})
    ns.subject_prefix = "flag"
    env = {"KVB_SUBJECT_PREFIX": "env", "KVB_ZMQ_ENDPOINT": "tcp://a:1, tcp://b:2", "KVB_JETSTREAM": "true",
           "KVB_GROUP_KIND": "1=mamba,2=sliding_window", "KVB_WORKER_ID": "w"}
    s = load_settings(ns, env)
    assert s.subject_prefix == "flag"
    assert s.zmq_endpoint == ["tcp://a:1", "tcp://b:2"]
    assert s.jetstream is True
    assert s.group_kind == {1: "mamba", 2: "sliding_window"}


def test_a_flag_takes_a_comma_separated_list_too() -> None:
    """`--nats-url a,b,c` names three servers, as KVB_NATS_URL=a,b,c does;
    repeated flags and commas mix."""
    from bridge.cli import build_parser
    from bridge.producer.config import load_settings

    args = build_parser().parse_args(["run", "--nats-url", "nats://a:4222,nats://b:4222, nats://c:4222",
                                      "--nats-url", "nats://d:4222", "--worker-id", "w"])
    s = load_settings(args, {})
    assert s.nats_url == ["nats://a:4222", "nats://b:4222", "nats://c:4222", "nats://d:4222"]


def test_worker_id_defaults_to_pod_name() -> None:
    import argparse

    from bridge.producer.config import load_settings

    ns = argparse.Namespace(**{o.dest: None for o in OPTIONS})
    assert load_settings(ns, {"POD_NAME": "vllm-7"}).worker_id == "vllm-7"


def test_dp_ranks_expand_ports_like_vllm() -> None:
    s = make_settings(zmq_endpoint=["tcp://10.0.0.1:5557"], replay_endpoint=["tcp://10.0.0.1:5600"], dp_ranks="3")
    assert s.stream_endpoints() == [
        (0, "tcp://10.0.0.1:5557", "tcp://10.0.0.1:5600"),
        (1, "tcp://10.0.0.1:5558", "tcp://10.0.0.1:5601"),
        (2, "tcp://10.0.0.1:5559", "tcp://10.0.0.1:5602"),
    ]


def test_secrets_never_in_repr_or_redacted_view(tmp_path: Path) -> None:
    import argparse

    from bridge.producer.config import load_settings

    ns = argparse.Namespace(**{o.dest: None for o in OPTIONS})
    s = load_settings(ns, {"KVB_NATS_PASSWORD": "hunter2-secret", "KVB_NATS_TOKEN": "tok-secret", "KVB_WORKER_ID": "w",
                           "KVB_NATS_USER": "bridge"})
    assert "hunter2" not in repr(s) and "tok-secret" not in repr(s)
    assert "hunter2" not in str(s.redacted()) and "tok-secret" not in str(s.redacted())


def test_secrets_have_no_flag() -> None:
    from bridge.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "--nats-password", "x"])


def test_bad_values_name_their_option() -> None:
    with pytest.raises(ConfigError, match="--replay-timeout"):
        make_settings(replay_timeout="-1")
    with pytest.raises(ConfigError, match="--worker-id"):
        make_settings(worker_id="x" * 300)
    with pytest.raises(ConfigError, match="--coalesce-ms"):
        make_settings(coalesce_ms="-1")
    with pytest.raises(ConfigError, match="--js-max-pending-bytes"):
        make_settings(js_max_pending_bytes="1000")
    with pytest.raises(ConfigError, match="--stream-max-bytes"):
        make_settings(stream_max_bytes="0")
    with pytest.raises(ConfigError, match="--stream-max-msgs-per-subject"):
        make_settings(stream_max_msgs_per_subject="0")


def test_readme_configuration_table_is_current() -> None:
    readme = (Path(__file__).parent.parent / "docs" / "configuration.md").read_text()
    assert options_table() in readme, "README's configuration table is stale: paste bridge.producer.config.options_table()"


def test_a_password_without_a_user_is_refused() -> None:
    import argparse

    from bridge.producer.config import load_settings

    ns = argparse.Namespace(**{o.dest: None for o in OPTIONS})
    with pytest.raises(ConfigError, match="--nats-user"):
        load_settings(ns, {"KVB_NATS_PASSWORD": "x", "KVB_WORKER_ID": "w"})
