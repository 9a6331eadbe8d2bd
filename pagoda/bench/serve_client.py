"""`pagoda bench serve` requests: the body of one streamed OpenAI completions or chat request,
its server-sent-event stream read chunk by chunk into a RequestResult (TTFT, inter-token gaps,
end-to-end latency, usage), and how its output tokens are counted afterwards."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagoda.bench.serve_prompts import ServeRequest, num_tokens

if TYPE_CHECKING:
    import httpx

DONE = "[DONE]"


@dataclass
class RequestResult:
    """One request as the client saw it; times in seconds, from the moment it was sent."""

    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_len: int = 0  # what was asked for (max_tokens)
    output_tokens: int = 0  # what came back, counted as output_tokens_source says
    output_tokens_source: str = ""  # one of COUNT_SOURCES
    retokenized_tokens: int = 0  # the whole text re-tokenized: a cross-check, lossy
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    e2el: float = 0.0
    start: float = 0.0  # send time (perf_counter; relative to the run's start after run_load)
    chunks: list[str] = field(default_factory=list)  # the text of each text-carrying chunk
    finish_reason: str | None = None
    usage_output_tokens: int | None = None
    usage_prompt_tokens: int | None = None
    server_output_tokens: int | None = None  # llama.cpp's timings.predicted_n, no usage sent

    @property
    def text(self) -> str:
        return "".join(self.chunks)

    @property
    def tpot(self) -> float | None:
        return tpot(self.e2el, self.ttft, self.output_tokens)


def tpot(e2el: float, ttft: float, output_tokens: int) -> float | None:
    """Time per output token after the first: (E2E - TTFT) / (n - 1); None for n <= 1."""
    if output_tokens <= 1:
        return None
    return (e2el - ttft) / (output_tokens - 1)


@dataclass(frozen=True)
class RequestConfig:
    url: str
    endpoint: str
    model: str
    temperature: float
    ignore_eos: bool
    logit_bias: dict[str, float] | None
    extra_body: dict[str, Any] | None
    headers: dict[str, str]


def request_body(req: ServeRequest, cfg: RequestConfig, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": cfg.model,
        "max_tokens": max_tokens,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.endpoint.endswith("/chat/completions"):
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.logit_bias:
        body["logit_bias"] = cfg.logit_bias
    elif cfg.ignore_eos:
        # Not with logit_bias: llama-cpp-python 0.3 then drops both (its logits-processor list
        # is replaced by list.extend's None), and its min_tokens bans only one of the EOG ids.
        body["min_tokens"] = max_tokens
    if cfg.extra_body:
        body.update(cfg.extra_body)
    return body


def parse_sse_line(line: str) -> dict[str, Any] | str | None:
    """A JSON chunk for `data: {...}`, DONE for `data: [DONE]`, None for anything else
    (blank separators, comments and pings, other SSE fields)."""
    if not line.startswith("data:"):
        return None
    data = line[len("data:") :].strip()
    if data == DONE:
        return DONE
    if not data:
        return None
    chunk = json.loads(data)
    return chunk if isinstance(chunk, dict) else None


def chunk_text(chunk: dict[str, Any]) -> str:
    """New text in a completions (choices[0].text) or chat (choices[0].delta.content) chunk."""
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:
        return (choice["delta"] or {}).get("content") or ""
    return choice.get("text") or ""


def finish_reason(chunk: dict[str, Any]) -> str | None:
    choices = chunk.get("choices") or []
    return choices[0].get("finish_reason") if choices else None


async def send_request(
    client: httpx.AsyncClient, req: ServeRequest, cfg: RequestConfig, max_tokens: int | None = None
) -> RequestResult:
    """Stream one request; every text-carrying chunk is a token arrival."""
    n_out = req.output_len if max_tokens is None else max_tokens
    result = RequestResult(prompt_len=req.prompt_len, output_len=n_out)
    body = request_body(req, cfg, n_out)
    t0 = time.perf_counter()
    result.start = t0
    last = t0
    try:
        async with client.stream("POST", cfg.url, json=body, headers=cfg.headers) as resp:
            if resp.status_code != 200:
                detail = (await resp.aread()).decode(errors="replace")[:300]
                result.error = f"HTTP {resp.status_code}: {detail}"
                return result
            async for line in resp.aiter_lines():
                event = parse_sse_line(line)
                if event is None:
                    continue
                if event == DONE:
                    break
                assert isinstance(event, dict)
                if "error" in event:
                    result.error = f"stream error: {json.dumps(event['error'])[:300]}"
                    return result
                usage = event.get("usage")
                if usage:
                    result.usage_output_tokens = usage.get("completion_tokens")
                    result.usage_prompt_tokens = usage.get("prompt_tokens")
                timings = event.get("timings")
                if isinstance(timings, dict) and "predicted_n" in timings:
                    result.server_output_tokens = timings["predicted_n"]
                result.finish_reason = finish_reason(event) or result.finish_reason
                text = chunk_text(event)
                if text:
                    now = time.perf_counter()
                    if not result.chunks:
                        result.ttft = now - t0
                    else:
                        result.itl.append(now - last)
                    last = now
                    result.chunks.append(text)
        result.e2el = time.perf_counter() - t0
    except Exception as e:  # a load generator records failures and goes on
        result.error = f"{type(e).__name__}: {e}"[:300]
        return result
    if not result.chunks:
        result.error = f"no text in the response (finish_reason {result.finish_reason})"
        return result
    result.success = True
    return result


# How a request's output tokens were counted, best first: the server's usage
# (stream_options.include_usage: pagoda, vLLM, llama.cpp's llama-server), llama-server's
# timings.predicted_n, else each streamed chunk re-tokenized on its own and summed (a chunk is
# one token in llama-cpp-python's stream unless several make up one UTF-8 character).
# Re-tokenizing the whole text is kept beside as a cross-check only: it undercounts, because a
# model's greedy output is often not the tokenizer's own split of that text (two tokens the
# tokenizer would merge into one), and tokens that decode to nothing vanish.
COUNT_SOURCES = ("usage", "server_timings", "chunks")


def count_output_tokens(results: Sequence[RequestResult], tokenizer: Any) -> None:
    """Each successful request's output_tokens and its source (COUNT_SOURCES), and the
    re-tokenized cross-check; after the run, so tokenizing never competes with the streams."""
    for r in results:
        if not r.success:
            continue
        r.retokenized_tokens = num_tokens(tokenizer, r.text)
        if r.usage_output_tokens is not None:
            r.output_tokens, r.output_tokens_source = int(r.usage_output_tokens), "usage"
        elif r.server_output_tokens is not None:
            r.output_tokens, r.output_tokens_source = int(r.server_output_tokens), "server_timings"
        else:
            r.output_tokens = sum(num_tokens(tokenizer, c) for c in r.chunks)
            r.output_tokens_source = "chunks"
        if r.usage_prompt_tokens is not None:
            r.prompt_len = int(r.usage_prompt_tokens)


def http_client() -> httpx.AsyncClient:
    import httpx

    # No pool cap (the benchmark's own semaphore is the only throttle); hour-long timeouts.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(3600.0), trust_env=False)


def auth_headers(api_key: str | None) -> dict[str, str]:
    key = api_key or os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def first_model_id(base_url: str, headers: dict[str, str]) -> str:
    import httpx

    url = base_url.rstrip("/") + "/v1/models"
    resp = httpx.get(url, headers=headers, timeout=30.0, trust_env=False)
    resp.raise_for_status()
    data = resp.json().get("data") or []
    if not data:
        raise ValueError(f"GET {url} lists no model; pass --model")
    return str(data[0]["id"])
