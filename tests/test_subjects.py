import re

from hypothesis import given
from hypothesis import strategies as st

from bridge.contract import escape_token, parse_worker_token, unescape_token, validate_prefix, worker_token
from bridge.producer.sink.subjects import SubjectBook

# What NATS forbids inside one token, and what would make it a wildcard.
_TOKEN = re.compile(r"^[^\s.*>]+$")


def test_hostile_ids_become_one_plain_token() -> None:
    for worker in ["a.b", "x y", "*", ">", "kv.>", "tenant/pod", "ünïcødé-ø", "日本語", "$SYS", "~7E", "a\tb"]:
        token = worker_token(worker, 0)
        assert _TOKEN.match(token), (worker, token)
        assert token.isascii()
        assert parse_worker_token(token) == (worker, 0)


def test_plain_pod_names_stay_readable() -> None:
    assert worker_token("vllm-worker-0", 0) == "vllm-worker-0"
    assert worker_token("vllm_worker_0", 3) == "vllm_worker_0-dp3"


def test_dp_suffix_cannot_collide_with_an_id_that_looks_like_one() -> None:
    assert worker_token("a-dp1", 0) != worker_token("a", 1)
    assert parse_worker_token(worker_token("a-dp1", 0)) == ("a-dp1", 0)
    assert parse_worker_token(worker_token("a-dp1", 2)) == ("a-dp1", 2)
    assert parse_worker_token(worker_token("a", 1)) == ("a", 1)


@given(st.text(min_size=1, max_size=40), st.integers(0, 64), st.text(min_size=1, max_size=40), st.integers(0, 64))
def test_escaping_is_injective(a: str, ra: int, b: str, rb: int) -> None:
    if (a, ra) != (b, rb):
        assert worker_token(a, ra) != worker_token(b, rb)
    assert parse_worker_token(worker_token(a, ra)) == (a, ra)


@given(st.text(max_size=60))
def test_unescape_inverts_escape(text: str) -> None:
    assert unescape_token(escape_token(text)) == text


def test_subject_book_shapes() -> None:
    book = SubjectBook("kv", "pod.1", 2)
    assert book.group(0) == "kv.pod~2E1-dp2.0"
    assert book.group(5) == "kv.pod~2E1-dp2.5"
    assert book.worker == "kv.pod~2E1-dp2.worker"


def test_prefix_refuses_wildcards() -> None:
    assert validate_prefix("kv.prod") == "kv.prod"
    for bad in ["kv.>", "*", "kv..x", "kv x", ""]:
        try:
            validate_prefix(bad)
        except ValueError:
            continue
        raise AssertionError(f"accepted {bad!r}")
