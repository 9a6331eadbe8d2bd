"""What the API process keeps and logs of finished requests: the info line of each, and the
timelines of the last N (`explain`, scheduling/explain.py: the engine sends a sample's timeline
with its last output), logged in full at debug level."""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict
from typing import Any

from pagoda.client.output_processor import RequestState

logger = logging.getLogger("pagoda.client.async_client")  # the finish lines keep their logger


class Explanations:
    """Timelines of the samples of the last `keep` finished requests, by request id."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self._by_request: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()

    def add(self, request_id: str, sample_timeline: dict[str, Any]) -> None:
        if self.keep == 0:
            return
        self._by_request.setdefault(request_id, []).append(sample_timeline)
        self._by_request.move_to_end(request_id)
        while len(self._by_request) > self.keep:
            self._by_request.popitem(last=False)

    def get(self, request_id: str) -> dict[str, Any] | None:
        """{"id", "object", "samples": [timeline per sample]}, None if not kept."""
        samples = self._by_request.get(request_id)
        if samples is None:
            return None
        return {"id": request_id, "object": "request.explanation", "samples": list(samples)}

    def log(self, request_id: str) -> None:
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("explain %s: %s", request_id, json.dumps(self.get(request_id)))


def finish_line(state: RequestState) -> str:
    m = state.metrics
    end = m.finished_time or time.time()
    queue = (m.first_scheduled_time - m.arrival_time) if m.first_scheduled_time else None
    ttft = m.time_to_first_token
    reasons = ",".join(str(s.finish_reason) for s in state.samples)
    return (
        f"finished request {state.request_id}: {reasons}, prompt {len(state.prompt_token_ids)} "
        f"tokens ({state.num_cached_tokens} cached), output "
        f"{sum(len(s.token_ids) for s in state.samples)} tokens, queue {_ms(queue)}, "
        f"TTFT {_ms(ttft)}, E2E {_ms(end - m.arrival_time)}"
    )


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"
