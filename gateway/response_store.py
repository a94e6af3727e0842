"""The responses kept for GET /v1/responses/{id} and `previous_response_id`: a bounded store in
the gateway's memory, by count and by bytes (--responses-max-count, --responses-max-bytes); the
oldest go first. Each entry keeps its response object and the conversation it ended (input and
output as chat messages, without instructions), so a continuation needs no other entry.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

import msgspec

from protocol import messages as m

log = logging.getLogger("verity.gateway")
DEFAULT_MAX_COUNT = 1000
DEFAULT_MAX_BYTES = 256 << 20


@dataclass
class Stored:
    response: dict  # the Response object, as served
    context: list[m.Message]  # the conversation through this response's output
    nbytes: int


def size_of(response: dict, context: list[m.Message]) -> int:
    """Bytes an entry takes, counted as its JSON text."""
    return len(msgspec.json.encode(response)) + len(msgspec.json.encode(context))


class ResponseStore:
    def __init__(self, max_count: int = DEFAULT_MAX_COUNT, max_bytes: int = DEFAULT_MAX_BYTES):
        self.max_count, self.max_bytes = max_count, max_bytes
        self.entries: OrderedDict[str, Stored] = OrderedDict()
        self.bytes = 0
        self.evicted = 0

    def put(self, rid: str, response: dict, context: list[m.Message]) -> bool:
        """Keeps (or replaces) an entry as the newest, evicting the oldest past either limit.
        An entry larger than the byte limit alone is not kept (False)."""
        nbytes = size_of(response, context)
        self.delete(rid)
        if nbytes > self.max_bytes or self.max_count < 1:
            log.warning("[%s] not stored: %d bytes exceed --responses-max-bytes %d", rid, nbytes, self.max_bytes)
            return False
        while self.entries and (len(self.entries) >= self.max_count or self.bytes + nbytes > self.max_bytes):
            old, entry = self.entries.popitem(last=False)
            self.bytes -= entry.nbytes
            self.evicted += 1
            log.info("[%s] evicted from the response store (oldest; %d entries, %d bytes)", old, len(self.entries),
                     self.bytes)
        self.entries[rid] = Stored(response, context, nbytes)
        self.bytes += nbytes
        return True

    def update(self, rid: str, response: dict, context: list[m.Message]) -> None:
        """Replaces an entry's content in place (a running response that ended); gone: nothing."""
        if rid in self.entries:
            self.put(rid, response, context)

    def get(self, rid: str) -> Optional[Stored]:
        return self.entries.get(rid)

    def delete(self, rid: str) -> bool:
        entry = self.entries.pop(rid, None)
        if entry is not None:
            self.bytes -= entry.nbytes
        return entry is not None

    def missing(self, rid: str) -> str:
        """The 404 message for an id not held."""
        return (f"no response with id `{rid}`: it is unknown, was deleted, was not stored (`store`: false) or was "
                f"evicted (this server keeps the last {self.max_count} responses within {self.max_bytes} bytes: "
                "--responses-max-count, --responses-max-bytes)")
