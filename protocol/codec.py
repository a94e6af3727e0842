"""msgpack codec for the sockets: one typed decoder per message union."""

from __future__ import annotations

from typing import Any

import msgspec

from protocol import messages as m

_encoder = msgspec.msgpack.Encoder()


def encode(msg: Any) -> bytes:
    return _encoder.encode(msg)


class Decoder:
    """Decodes only the message types of one socket; anything else raises DecodeError."""

    def __init__(self, kind: Any):
        self._dec = msgspec.msgpack.Decoder(kind)

    def decode(self, data: bytes) -> Any:
        try:
            return self._dec.decode(data)
        except UnicodeDecodeError as e:  # msgspec lets invalid UTF-8 in a str through as this
            raise msgspec.DecodeError(f"invalid UTF-8 in a string: {e.reason} at byte {e.start}") from None


DecodeError = msgspec.DecodeError  # ValidationError is a subclass


def job_decoder() -> Decoder:
    return Decoder(m.JobMessage)


def control_decoder() -> Decoder:
    return Decoder(m.ControlMessage)


def worker_out_decoder() -> Decoder:
    return Decoder(m.WorkerOutMessage)


def supervisor_decoder() -> Decoder:
    return Decoder(m.SupervisorMessage)


def stats_decoder() -> Decoder:
    return Decoder(m.StatsSnapshot)


def cache_request_decoder() -> Decoder:
    return Decoder(m.CacheRequest)


def cache_reply_decoder() -> Decoder:
    return Decoder(m.CacheServiceMessage)
