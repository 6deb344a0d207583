"""Why JetStream did not store a message, classified once where the reply is read.

An ack reply is a PubAck, or one of these. The publisher decides what to do
by class, never by the reply's text: `NoLeader` waits an election out,
`NoResponders` asks whether the stream still exists, the rest are counted
towards giving the message up.
"""

from __future__ import annotations

import msgspec

# A PubAck is `{"stream":...,"seq":...}` (maybe `"duplicate":true`); a refusal
# is `{"error":{...}}`. Nothing else has to be read to tell them apart.
_ERROR_KEY = b'"error"'

# JSClusterNotAvailErr: no meta leader or stream leader right now.
_ERR_NOT_AVAILABLE = 10008
_NOT_AVAILABLE_TEXT = "temporarily unavailable"


class _ApiError(msgspec.Struct):
    code: int = 0
    err_code: int = 0
    description: str = ""


class _ErrorReply(msgspec.Struct):
    error: _ApiError


class PublishRefusal(Exception):
    """The stream's answer to one publish, other than a PubAck. `counts`:
    whether it counts towards giving the message up."""

    counts = True

    def __init__(self, detail: str, err_code: int = 0) -> None:
        super().__init__(detail)
        self.detail = detail
        self.err_code = err_code

    @classmethod
    def from_ack(cls, data: bytes, headers: bytes | None) -> PublishRefusal | None:
        """None for a PubAck; else the refusal, of its class."""
        if headers and headers[8:9] == b" ":
            # An inline status (`NATS/1.0 503\r\n\r\n`): no stream took the subject.
            status = bytes(headers[9:12]).decode(errors="replace")
            return NoResponders(f"status {status}") if status == "503" else StatusReply(f"status {status}")
        if _ERROR_KEY in data[:16]:
            text = bytes(data[:200]).decode(errors="replace")
            try:
                error = msgspec.json.decode(data, type=_ErrorReply).error
            except msgspec.DecodeError:
                return StreamRefused(text)
            if error.err_code == _ERR_NOT_AVAILABLE or _NOT_AVAILABLE_TEXT in error.description:
                return NoLeader(text, error.err_code)
            return StreamRefused(text, error.err_code)
        if not data.startswith(b"{"):
            return NotAPubAck("not a PubAck")
        return None


class NoResponders(PublishRefusal):
    """No stream answered on the subject (an inline 503): deleted, its
    subjects changed, or its leader being elected."""


class StatusReply(PublishRefusal):
    """An inline status other than 503."""


class NoLeader(PublishRefusal):
    """Nobody stores anything right now (no leader): not a refusal, waited out."""

    counts = False


class StreamRefused(PublishRefusal):
    """The stream refused the message (limits, a wrong expectation, ...)."""


class NotAPubAck(PublishRefusal):
    """A reply that is neither a PubAck nor an error."""


class NoStream(PublishRefusal):
    """After a 503: no stream takes the subject (`made_again`: the bridge made it again)."""

    def __init__(self, made_again: bool) -> None:
        super().__init__("no stream takes the subject" + (" (made again)" if made_again else ""))
        self.made_again = made_again


class PermissionRefused(PublishRefusal):
    """The server's permissions forbid the publish."""

    def __init__(self) -> None:
        super().__init__("permission denied")


ack_error = PublishRefusal.from_ack
