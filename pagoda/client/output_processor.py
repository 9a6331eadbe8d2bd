"""Client side of the engine: EngineCoreOutputs -> detokenized, grouped RequestOutputs.

One `RequestState` per user request; an n > 1 request owns n samples (engine requests named
by `sample_request_id`). A stop string found in the detokenized text finishes that sample here and
asks the caller to abort it in the engine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from pagoda.client.detokenizer import IncrementalDetokenizer, decode_token
from pagoda.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestMetrics, RequestOutput
from pagoda.sampling_params import SamplingParams
from pagoda.scheduling.messages import EngineCoreOutput, LogprobEntry, sample_request_id


@dataclass
class SampleState:
    index: int
    detok: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_returned_tokens: int = 0


class RequestState:
    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer: Any,
        arrival_time: float,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.tokenizer = tokenizer
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.num_cached_tokens = 0
        self.pooled: bytes | None = None  # --runner pooling: the engine's vector
        self.prompt_logprobs: PromptLogprobs | None = None
        if params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]
        want_lp = params.logprobs is not None
        self.samples = [
            SampleState(
                index=i,
                detok=IncrementalDetokenizer(tokenizer, prompt_token_ids, params)
                if params.detokenize and tokenizer is not None
                else None,
                logprobs=[] if want_lp else None,
                cumulative_logprob=0.0 if want_lp else None,
            )
            for i in range(params.n)
        ]
        # Samples without a finish_reason; only _finish() sets one (checked per output).
        self.num_unfinished = params.n

    @property
    def finished(self) -> bool:
        return self.num_unfinished == 0

    def _finish(self, sample: SampleState, reason: str, stop_reason: int | str | None) -> None:
        assert sample.finish_reason is None
        sample.finish_reason, sample.stop_reason = reason, stop_reason
        self.num_unfinished -= 1

    def _logprob_dict(self, entry: LogprobEntry) -> dict[int, Logprob]:
        ids, lps, rank = entry
        out = {ids[0]: Logprob(lps[0], rank, self._decode(ids[0]))}
        for r, (tid, lp) in enumerate(zip(ids[1:], lps[1:]), start=1):
            if tid not in out:
                out[tid] = Logprob(lp, r, self._decode(tid))
        return out

    def _decode(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        return decode_token(self.tokenizer, token_id)

    def add(self, out: EngineCoreOutput) -> str | None:
        """Fold one engine output in; returns the sample's engine id if it must be aborted."""
        now = time.time()
        self.num_cached_tokens = out.num_cached_tokens
        if out.pooled is not None:
            self.pooled = out.pooled
        if self.metrics.first_scheduled_time is None:
            self.metrics.first_scheduled_time = out.first_scheduled_time
        if out.new_prompt_logprobs and self.prompt_logprobs is not None:
            self.prompt_logprobs.extend(self._logprob_dict(e) for e in out.new_prompt_logprobs)
        sample = self.samples[out.sample_index]
        if sample.finish_reason is not None:
            # Tokens in flight when the client stopped the sample (a stop string; the abort
            # reaches the engine after its next outputs): not part of the result.
            return None
        if out.new_token_ids:
            if self.metrics.first_token_time is None:
                self.metrics.first_token_time = now
            self.metrics.last_token_time = now
        sample.token_ids.extend(out.new_token_ids)
        for entry in out.new_logprobs:
            assert sample.logprobs is not None and sample.cumulative_logprob is not None
            sample.logprobs.append(self._logprob_dict(entry))
            sample.cumulative_logprob += entry[1][0]
        abort = None
        if sample.detok is not None and out.new_token_ids:
            stop = sample.detok.update(
                out.new_token_ids,
                stop_terminated=out.finish_reason == "stop" and not out.grammar_ended,
            )
            if stop is not None:
                if out.finish_reason is None:
                    abort = sample_request_id(self.request_id, sample.index)
                self._finish(sample, "stop", stop)
        if sample.finish_reason is None and out.finish_reason is not None:
            self._finish(sample, out.finish_reason, out.stop_reason)
        if self.finished:
            self.metrics.finished_time = now
        return abort

    def abort(self) -> None:
        for s in self.samples:
            if s.finish_reason is None:
                self._finish(s, "abort", None)
        self.metrics.finished_time = time.time()

    def make_output(self, delta: bool = False) -> RequestOutput:
        """The request so far; with delta=True each sample carries only what is new since the
        last delta output (for streaming)."""
        completions = []
        for s in self.samples:
            text = s.detok.output_text if s.detok is not None else ""
            token_ids, logprobs = s.token_ids, s.logprobs
            if delta:
                done = s.finish_reason is not None
                text = s.detok.get_delta(finished=done) if s.detok is not None else ""
                token_ids = s.token_ids[s.num_returned_tokens :]
                if logprobs is not None:
                    logprobs = logprobs[s.num_returned_tokens :]
                s.num_returned_tokens = len(s.token_ids)
            completions.append(
                CompletionOutput(
                    index=s.index,
                    text=text,
                    token_ids=list(token_ids),
                    cumulative_logprob=s.cumulative_logprob,
                    logprobs=logprobs,
                    finish_reason=s.finish_reason,
                    stop_reason=s.stop_reason,
                )
            )
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=self.prompt_logprobs,
            outputs=completions,
            finished=self.finished,
            num_cached_tokens=self.num_cached_tokens,
            metrics=self.metrics,
        )
