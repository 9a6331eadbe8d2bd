"""LLM: the offline Python API, shaped like vLLM's so code ports with an import change."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence
from typing import Any

from tqdm.auto import tqdm

from pagoda.client.beam_search import beam_search
from pagoda.client.output_processor import RequestState
from pagoda.client.pooling import (
    POOLING_SAMPLING,
    check_embedder,
    check_pooling_params,
    check_runner,
    embedding,
)
from pagoda.client.scoring import check_classifier, label_probs, pair_prompt, score_pairs
from pagoda.client.tokenizer import Conversation, apply_chat_template, as_conversations
from pagoda.client.validation import check_request
from pagoda.config import EngineConfig
from pagoda.engine.core import EngineCore
from pagoda.lora_request import LoRARequest
from pagoda.outputs import (
    BeamSearchOutput,
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from pagoda.pooler_config import PoolingParams
from pagoda.sampling_params import BeamSearchParams, SamplingParams
from pagoda.scheduling.messages import EngineRequest

PromptType = str | dict[str, Any]


class LLM:
    """Offline engine. `model=None` loads the embedded SmolLM2-135M-Instruct (Q4_1 GGUF).

    Engine arguments use vLLM's names: dtype, seed, max_model_len, block_size,
    enable_prefix_caching, kv_cache_memory_bytes, num_gpu_blocks_override, max_num_seqs,
    max_num_batched_tokens, scheduling_policy, device, load_format, tokenizer,
    skip_tokenizer_init, speculative_config, tensor_parallel_size. With skip_tokenizer_init there is no tokenizer: prompts must be
    {"prompt_token_ids": [...]}, outputs carry token ids and empty text, and stop strings, chat
    and text prompts raise ValueError.
    """

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.config = EngineConfig.from_kwargs(model, **engine_args)
        self.engine = EngineCore(self.config)
        self.tokenizer = self.engine.tokenizer
        self._info = self.engine.info()
        self._ids = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    # ---- generate ----------------------------------------------------------------------
    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """lora_request: the adapter every prompt runs with, or one (or None) per prompt
        (an engine started with enable_lora=True)."""
        prompt_list = _as_list(prompts)
        params = self._params_per_prompt(sampling_params, len(prompt_list))
        loras = _loras_per_prompt(lora_request, len(prompt_list))
        if priority is not None:
            if not isinstance(priority, (list, tuple)) or len(priority) != len(prompt_list):
                raise ValueError("priority must be a list of ints with one entry per prompt")
            bad = [p for p in priority if not isinstance(p, int) or isinstance(p, bool)]
            if bad:
                raise ValueError(f"priority must be a list of ints, got {bad[0]!r} in it")
        states: list[RequestState] = []
        try:
            for i, (prompt, p) in enumerate(zip(prompt_list, params)):
                text, ids = self._tokenize(prompt)
                extra = prompt if isinstance(prompt, dict) else {}
                states.append(
                    self._add(
                        text,
                        ids,
                        p,
                        priority[i] if priority else 0,
                        extra.get("cache_salt"),
                        extra.get("kv_transfer_params"),
                        lora_request=loras[i],
                    )
                )
        except Exception:
            self.engine.abort_request([s.request_id for s in states])
            raise
        return self._run(states, use_tqdm)

    def _params_per_prompt(
        self, sampling_params: SamplingParams | Sequence[SamplingParams] | None, n: int
    ) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        if not isinstance(sampling_params, Sequence) or not all(
            isinstance(p, SamplingParams) for p in sampling_params
        ):
            raise _params_type_error("sampling_params", SamplingParams, sampling_params, True)
        params = list(sampling_params)
        if len(params) != n:
            raise ValueError(
                f"got {len(params)} SamplingParams for {n} prompts: give one or one per prompt"
            )
        return params

    def _require_tokenizer(self, what: str) -> Any:
        if self.tokenizer is None:
            raise ValueError(
                f"{what} needs a tokenizer, but this LLM runs with skip_tokenizer_init=True; "
                "give prompts as {'prompt_token_ids': [...]} or load a model with tokenizer files"
            )
        return self.tokenizer

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self._require_tokenizer("a text prompt").encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
                    raise ValueError("prompt_token_ids must be a list of ints")
                return prompt.get("prompt"), list(ids)
            if "prompt" in prompt and isinstance(prompt["prompt"], str):
                tokenizer = self._require_tokenizer("a text prompt")
                return prompt["prompt"], tokenizer.encode(prompt["prompt"])
        raise ValueError(
            "a prompt must be a str, {'prompt': str} or {'prompt_token_ids': list[int]}, "
            f"got {type(prompt).__name__}"
        )

    def _add(
        self,
        text: str | None,
        ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
        pooling: bool = False,
        lora_request: LoRARequest | None = None,
    ) -> RequestState:
        """kv_transfer_params: a kv_consumer's remote prefill (kv_transfer_config.py). pooling:
        an embedding request (a model run with runner="pooling"), else a generation."""
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError("cache_salt must be a string")
        if kv_transfer_params is not None and not isinstance(kv_transfer_params, dict):
            raise ValueError("kv_transfer_params must be a dict")
        check_runner(self._info, pooling)
        if params.stop:
            self._require_tokenizer("a stop string")
        max_num_seqs = self.config.scheduler.max_num_seqs
        check_request(self._info, max_num_seqs, ids, params, kv_transfer_params, pooling)
        if params.structured_outputs is not None:
            from pagoda.engine.grammar import check_structured_outputs

            check_structured_outputs(params.structured_outputs)
        rid = str(next(self._ids))
        arrival = time.time()
        request = EngineRequest(
            rid, ids, params, arrival, priority, cache_salt, kv_transfer_params, lora_request
        )
        self.engine.add_request(request)
        return RequestState(rid, text, ids, params, self.tokenizer, arrival)

    def _run(self, states: list[RequestState], use_tqdm: bool) -> list[RequestOutput]:
        by_id = {s.request_id: s for s in states}
        pending = len(states)
        bar = tqdm(total=pending, desc="Processed prompts", disable=not use_tqdm)
        try:
            while pending:
                for out in self.engine.step():
                    state = by_id.get(out.parent_id)
                    if state is None:
                        continue
                    was_finished = state.finished
                    abort_id = state.add(out)
                    if abort_id is not None:
                        self.engine.abort_sample(abort_id)
                    if state.finished and not was_finished:
                        pending -= 1
                        bar.update(1)
        except BaseException:
            self.engine.abort_request([s.request_id for s in states if not s.finished])
            raise
        finally:
            bar.close()
        return [s.make_output() for s in states]

    # ---- embed -------------------------------------------------------------------------
    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """vLLM's LLM.embed: one vector per prompt, from a model run with runner="pooling"
        (pooled as its pooler config says, runner/pooler.py). ValueError on a generating model."""
        prompt_list = _as_list(prompts)
        params = _pooling_params_per_prompt(pooling_params, len(prompt_list))
        check_runner(self._info, pooling=True)
        check_embedder(self._info)
        for p in params:
            check_pooling_params(self._info, p)
        states = self._pool([self._tokenize(prompt) for prompt in prompt_list], use_tqdm)
        return [
            EmbeddingRequestOutput(
                s.request_id,
                s.prompt_token_ids,
                EmbeddingOutput(embedding(s.pooled or b"", p, self._info)),
                num_cached_tokens=s.num_cached_tokens,
            )
            for s, p in zip(states, params)
        ]

    # ---- score, classify ---------------------------------------------------------------
    def score(
        self, data_1: str | list[str], data_2: str | list[str], use_tqdm: bool = True
    ) -> list[ScoringRequestOutput]:
        """vLLM's LLM.score: one score per pair of a one-label classifier (sigmoid of its logit),
        pairing one data_1 with each data_2 or element-wise; each pair is the tokenizer's text
        pair (client/scoring.py)."""
        check_classifier(self._info, "LLM.score", one_label=True)
        pairs = score_pairs(data_1, data_2)
        tokenizer = self._require_tokenizer("a score")
        states = self._pool([pair_prompt(tokenizer, a, b) for a, b in pairs], use_tqdm)
        return [
            ScoringRequestOutput(
                s.request_id,
                s.prompt_token_ids,
                ScoringOutput(label_probs(s.pooled or b"")[0]),
                num_cached_tokens=s.num_cached_tokens,
            )
            for s in states
        ]

    def classify(
        self, prompts: PromptType | Sequence[PromptType], use_tqdm: bool = True
    ) -> list[ClassificationRequestOutput]:
        """vLLM's LLM.classify: each prompt's label probabilities (softmax; the sigmoid of a
        one-label classifier's logit)."""
        check_classifier(self._info, "LLM.classify", one_label=False)
        states = self._pool([self._tokenize(p) for p in _as_list(prompts)], use_tqdm)
        return [
            ClassificationRequestOutput(
                s.request_id,
                s.prompt_token_ids,
                ClassificationOutput(label_probs(s.pooled or b"")),
                num_cached_tokens=s.num_cached_tokens,
            )
            for s in states
        ]

    def _pool(
        self, prompts: list[tuple[str | None, list[int]]], use_tqdm: bool
    ) -> list[RequestState]:
        """Run pooling requests to the end; a refused one aborts those already added."""
        states: list[RequestState] = []
        try:
            for text, ids in prompts:
                states.append(self._add(text, ids, POOLING_SAMPLING, pooling=True))
        except Exception:
            self.engine.abort_request([s.request_id for s in states])
            raise
        self._run(states, use_tqdm)
        return states

    def generate_stream(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        lora_request: LoRARequest | None = None,
    ) -> Iterator[RequestOutput]:
        """Yield delta outputs (new text and tokens of each sample) as the engine steps.
        lora_request: the adapter the prompt runs with (an engine with enable_lora=True)."""
        if sampling_params is not None and not isinstance(sampling_params, SamplingParams):
            raise _params_type_error("sampling_params", SamplingParams, sampling_params)
        if lora_request is not None and not isinstance(lora_request, LoRARequest):
            raise ValueError("lora_request must be a LoRARequest or None")
        text, ids = self._tokenize(prompt)
        state = self._add(text, ids, sampling_params or SamplingParams(), lora_request=lora_request)
        try:
            while not state.finished:
                for out in self.engine.step():
                    if out.parent_id != state.request_id:
                        continue
                    abort_id = state.add(out)
                    if abort_id is not None:
                        self.engine.abort_sample(abort_id)
                yield state.make_output(delta=True)
        finally:
            if not state.finished:
                self.engine.abort_request(state.request_id)

    def chat_stream(
        self, conversation: Conversation, sampling_params: SamplingParams | None = None
    ) -> Iterator[str]:
        """Stream the reply text of one conversation, piece by piece."""
        if sampling_params is not None and not isinstance(sampling_params, SamplingParams):
            raise _params_type_error("sampling_params", SamplingParams, sampling_params)
        text = self.apply_chat_template(conversation)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        for out in self.generate_stream({"prompt": text, "prompt_token_ids": ids}, sampling_params):
            if out.outputs[0].text:
                yield out.outputs[0].text

    # ---- chat --------------------------------------------------------------------------
    def chat(
        self,
        messages: Conversation | list[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Replies to conversations under the chat template; `tools` (OpenAI's function
        definitions) are rendered into the prompt, and the replies' tool calls can be read with
        pagoda.client.tool_calls.parse_tool_calls."""
        conversations = as_conversations(messages)
        self._params_per_prompt(sampling_params, len(conversations))  # TypeError before templating
        prompts: list[PromptType] = [
            {
                "prompt": text,
                "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False),
            }
            for text in (
                self.apply_chat_template(
                    c, chat_template, add_generation_prompt, continue_final_message, tools
                )
                for c in conversations
            )
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def apply_chat_template(
        self,
        conversation: Conversation,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        return apply_chat_template(
            self._require_tokenizer("chat"),
            conversation,
            chat_template,
            add_generation_prompt,
            continue_final_message,
            tools,
        )

    # ---- beam search -------------------------------------------------------------------
    def beam_search(
        self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams
    ) -> list[BeamSearchOutput]:
        if not isinstance(params, BeamSearchParams):
            raise _params_type_error("params", BeamSearchParams, params)
        prompt_ids = [self._tokenize(p)[1] for p in _as_list(prompts)]
        return beam_search(
            self._generate_ids, self.engine.eos_token_ids, self.tokenizer, prompt_ids, params
        )

    def _generate_ids(
        self, prompts: list[list[int]], params: SamplingParams
    ) -> list[RequestOutput]:
        return self.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _params_type_error(
    arg: str, expected: type, got: object, per_prompt: bool = False
) -> TypeError:
    name = expected.__name__
    what = f"a {name} or a list of {name} (one per prompt)" if per_prompt else f"a {name}"
    hint = f"; for a dict d, pass {name}(**d)" if isinstance(got, dict) else ""
    return TypeError(f"{arg} must be {what}, got {type(got).__name__}{hint}")


def _pooling_params_per_prompt(
    pooling_params: PoolingParams | Sequence[PoolingParams] | None, n: int
) -> list[PoolingParams]:
    if pooling_params is None or isinstance(pooling_params, PoolingParams):
        return [pooling_params or PoolingParams()] * n
    if not isinstance(pooling_params, Sequence) or not all(
        isinstance(p, PoolingParams) for p in pooling_params
    ):
        raise _params_type_error("pooling_params", PoolingParams, pooling_params, True)
    if len(pooling_params) != n:
        raise ValueError(
            f"got {len(pooling_params)} PoolingParams for {n} prompts: give one or one per prompt"
        )
    return list(pooling_params)


def _loras_per_prompt(
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None, n: int
) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * n
    loras = list(lora_request) if isinstance(lora_request, Sequence) else None
    if loras is None or not all(r is None or isinstance(r, LoRARequest) for r in loras):
        raise ValueError("lora_request must be a LoRARequest, or a list of them (or None)")
    if len(loras) != n:
        raise ValueError(
            f"got {len(loras)} lora_requests for {n} prompts: give one or one per prompt"
        )
    return loras


def _as_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    return list(prompts)
