"""Pooler: `--runner pooling` turns each request's prompt hidden states into one float32 vector
(an embedding) in the step in which its prompt catches up; nothing is sampled.

A prompt may be computed over several steps (chunked prefill): MEAN keeps a running float32 sum
and CLS the first row between them. Both need every prompt row computed here, so the engine
runs them without prefix caching (engine/core.py); LAST reads only the last row, which a prefix
hit never covers (the scheduler computes at least a prompt's last token).

A classifier (pooler_config.Classifier) applies its head to the pooled vector, so the engine
returns the label logits (float32) instead: the checkpoint's `score` Linear
(models/score_head.py), or the LM head's logits of classifier_from_token's tokens (their
difference, yes minus no, for the Qwen3-Reranker recipe).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagoda.models.interface import CausalLM
from pagoda.models.score_head import ScoreHead
from pagoda.pooler_config import Classifier
from pagoda.runner.pending_output import PendingOutput
from pagoda.scheduling.messages import ScheduledRequest

# pooled vectors (n, hidden_size) in the model's dtype -> label logits (n, num_labels) float32
Head = Callable[[torch.Tensor], torch.Tensor]


def classifier_head(model: CausalLM, classifier: Classifier) -> Head:
    """The head that turns a pooled hidden state into the classifier's label logits."""
    if not classifier.token_ids:
        score = getattr(model, "score", None)
        assert isinstance(score, ScoreHead), "the loader adds a classifier's score head"
        return score
    ids = list(classifier.token_ids)

    def from_tokens(vectors: torch.Tensor) -> torch.Tensor:
        logits = model.compute_logits(vectors)[:, ids]  # (n, len(ids)) float32
        return logits[:, 1:] - logits[:, :1] if classifier.yes_minus_no else logits

    return from_tokens


class Pooler:
    def __init__(
        self, pooling_type: str, head: Head | None = None, dtype: torch.dtype = torch.float32
    ) -> None:
        """pooling_type: LAST, MEAN or CLS (pooler_config.POOLING_TYPES). head: a classifier's
        (classifier_head), which takes vectors in `dtype` (the model's)."""
        self.pooling_type = pooling_type
        self.head = head
        self.dtype = dtype
        self.partial: dict[str, torch.Tensor] = {}  # request id -> MEAN's sum, CLS's row

    def drop(self, request_ids: list[str]) -> None:
        """Forget finished and preempted requests (a preempted one is recomputed from 0)."""
        for rid in request_ids:
            self.partial.pop(rid, None)

    def pool(self, scheduled: list[ScheduledRequest], hidden: torch.Tensor) -> PendingOutput:
        """hidden: (num_tokens, hidden_size), each request's rows in `scheduled` order -> the
        step's output: the vectors (float32 bytes, native order) of the requests whose prompts
        end this step."""
        done: dict[str, torch.Tensor] = {}
        end = 0
        for s in scheduled:
            rows = hidden[end : end + len(s.token_ids)]  # (n, hidden_size)
            end += len(s.token_ids)
            partial = self._fold(s, rows)
            if not s.sample_ids:  # the prompt goes on in a later step
                if partial is not None:
                    self.partial[s.request_id] = partial
                continue
            self.partial.pop(s.request_id, None)
            if self.pooling_type == "LAST":
                done[s.request_id] = rows[-1].float()
            elif self.pooling_type == "MEAN":
                assert partial is not None
                done[s.request_id] = partial / (s.start + len(s.token_ids))
            else:
                assert partial is not None, "CLS: the prompt's first row was not computed here"
                done[s.request_id] = partial
        pooled: dict[str, bytes] = {}
        if done:
            vectors = torch.stack(list(done.values()))
            if self.head is not None:
                vectors = self.head(vectors.to(self.dtype))
            vectors = vectors.cpu()  # one copy to the host
            pooled = {rid: v.numpy().tobytes() for rid, v in zip(done, vectors)}
        return PendingOutput([], [], None, None, {}, pooled=pooled)

    def _fold(self, s: ScheduledRequest, rows: torch.Tensor) -> torch.Tensor | None:
        """MEAN: the sum so far with these rows; CLS: the first row once seen; LAST: None."""
        before = self.partial.get(s.request_id)
        if self.pooling_type == "MEAN":
            total = rows.float().sum(dim=0)
            return total if before is None else before + total
        if self.pooling_type == "CLS":
            return rows[0].float().clone() if s.start == 0 else before  # hidden is reused
        return None
