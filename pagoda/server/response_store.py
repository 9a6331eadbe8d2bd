"""The responses /v1/responses keeps (unless `store: false`), in memory: each with the
conversation it ends, so that `previous_response_id` continues it.

The store is bounded: past MAX_STORED_RESPONSES the least recently used response is dropped
(created, read or continued counts as a use); a dropped id is unknown (404), as after a restart.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from pagoda.server.protocol import ChatMessage
from pagoda.server.responses_protocol import ResponseObject

MAX_STORED_RESPONSES = 1000


@dataclass(frozen=True)
class StoredResponse:
    response: ResponseObject
    # the conversation up to and including this response's output, without its instructions
    # (a continuation gives its own, as OpenAI's previous_response_id does)
    messages: list[ChatMessage]


class ResponseStore:
    def __init__(self, max_count: int = MAX_STORED_RESPONSES) -> None:
        assert max_count >= 1
        self.max_count = max_count
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, entry: StoredResponse) -> None:
        rid = entry.response.id
        self._entries[rid] = entry
        self._entries.move_to_end(rid)
        while len(self._entries) > self.max_count:
            self._entries.popitem(last=False)

    def get(self, rid: str) -> StoredResponse | None:
        entry = self._entries.get(rid)
        if entry is not None:
            self._entries.move_to_end(rid)
        return entry

    def delete(self, rid: str) -> bool:
        return self._entries.pop(rid, None) is not None
