"""Frame checks on the PUB and replay sockets: any multipart message is a Frame
or a FrameError with a reason from the documented set, never anything else."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from bridge.producer.source.frames import END_SEQ, FrameError, parse_pub, parse_replay
from bridge.producer.telemetry.metrics import MALFORMED_REASONS

EXAMPLES = int(os.environ.get("KVB_FUZZ_EXAMPLES", "200"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MAX = 4096

# small frames, and frames right at the size limit (built, not drawn byte by byte)
frame = st.one_of(st.binary(max_size=16), st.integers(MAX - 2, MAX + 2).map(lambda n: b"x" * n))
frames = st.lists(frame, max_size=6)


@FUZZ
@given(frames)
@example([])
@example([b""])
@example([b"", b"\x00" * 8, b"x" * (MAX + 1)])
@example([b"t" * 1025, b"\x00" * 8, b""])
@example([b"", b"\xff" * 8, b""])
def test_pub_frames(parts: list[bytes]) -> None:
    try:
        f = parse_pub(parts, MAX)
    except FrameError as exc:
        assert exc.reason in MALFORMED_REASONS
        return
    assert len(parts) == 3 and len(parts[1]) == 8
    assert 0 <= f.seq < 2**64 and len(f.payload) <= MAX and len(f.topic) <= 1024


@FUZZ
@given(frames)
@example([b"", b"", b"\xff" * 8, b""])
@example([b"", b"\xff" * 8, b""])
@example([b"x", b"t", b"\x00" * 8, b"p"])
def test_replay_frames(parts: list[bytes]) -> None:
    try:
        f = parse_replay(parts, MAX)
    except FrameError as exc:
        assert exc.reason in MALFORMED_REASONS
        return
    assert parts[0] == b"" and len(parts) in (3, 4)
    assert f.seq == END_SEQ or (0 <= f.seq < 2**64 and len(f.payload) <= MAX)
