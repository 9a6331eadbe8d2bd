"""A base for test proposers that draft from a known continuation (speculative-decoding tests):
they keep no per-request statistics, so the runner's bookkeeping calls do nothing."""

from __future__ import annotations


class FixedDrafts:
    def record(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        pass

    def remove(self, request_id: str) -> None:
        pass
