"""Prefill/decode disaggregation at the engine level (kv_transfer_config.py,
distributed/kv_transfer.py, engine/remote_prefill.py): a kv_producer computes each prompt (one
token, as the proxy asks it to), a kv_consumer fetches the prompt's blocks from it into its prefix
cache and decodes on. Outputs must equal one colocated engine's token for token; a fetch that
fails is tried again, then the consumer computes the prompt itself, with the same outputs.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from typing import Any

import pytest

from pagoda import LLM, SamplingParams
from pagoda.outputs import RequestOutput
from tests.engine.test_scheduling_invariance import _params, _prompts
from tests.equivalence import assert_same_outputs

PROMPTS = _prompts(8, seed=5, shared_prefix=16)
PARAMS = _params(len(PROMPTS))
ENGINE: dict[str, Any] = dict(
    skip_tokenizer_init=True, max_num_batched_tokens=64, num_gpu_blocks_override=64, block_size=8
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _kv(role: str, port: int, **extra: Any) -> dict[str, Any]:
    config: dict[str, Any] = {"kv_connector": "PagodaConnector", "kv_role": role, "kv_port": port}
    if extra:
        config["kv_connector_extra_config"] = extra
    return config


def _prefill(producer: LLM) -> None:
    """What the proxy asks of the prefill instance: each prompt, one token."""
    one = SamplingParams(max_tokens=1, temperature=0)
    producer.generate([{"prompt_token_ids": p} for p in PROMPTS], one, use_tqdm=False)


def _decode(consumer: LLM, port: int) -> list[RequestOutput]:
    remote = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": port}
    prompts = [{"prompt_token_ids": p, "kv_transfer_params": remote} for p in PROMPTS]
    return consumer.generate(prompts, PARAMS, use_tqdm=False)


@pytest.fixture
def colocated(tiny_weights_dir: Callable[[str], str]) -> list[RequestOutput]:
    llm = LLM(tiny_weights_dir("llama"), **ENGINE)
    return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)


SLOW = pytest.mark.slow


# Qwen2 and Qwen3 are slow-marked to keep the default suite's time.
@pytest.mark.parametrize(
    "arch", ["llama", pytest.param("qwen2", marks=SLOW), pytest.param("qwen3", marks=SLOW)]
)
def test_decode_instance_continues_from_transferred_blocks(
    tiny_weights_dir: Callable[[str], str], arch: str
) -> None:
    folder, port = tiny_weights_dir(arch), _free_port()
    want = LLM(folder, **ENGINE).generate(
        [{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False
    )
    producer = LLM(folder, kv_transfer_config=_kv("kv_producer", port), **ENGINE)
    consumer = LLM(folder, kv_transfer_config=_kv("kv_consumer", _free_port()), **ENGINE)
    _prefill(producer)
    got = _decode(consumer, port)
    assert_same_outputs(got, want)
    received = consumer.engine.stats().kv_transfer
    sent = producer.engine.stats().kv_transfer
    # each prompt's full blocks but those an earlier prompt's shared prefix brought
    assert 0 < received["fetches"] <= len(PROMPTS) and received["fetch_failures"] == 0
    assert received["blocks_received"] == sent["blocks_sent"] > 0
    assert received["bytes_received"] == sent["bytes_sent"] > 0
    # the consumer computed only each prompt's tail: the rest were prefix-cache hits (but for
    # prompts with prompt logprobs, every fourth, which score every prompt token)
    for out, prompt, params in zip(got, PROMPTS, PARAMS):
        full = 0 if params.prompt_logprobs else (len(prompt) - 1) // 8 * 8
        assert out.num_cached_tokens == full
    # the connector's scheduler side holds no block data: the worker side holds it all, and
    # what the consumer fetched was written (none waits for a load)
    for llm in (producer, consumer):
        assert not _tensors_in(vars(llm.engine.remote_prefill))
    assert consumer.engine.executor.kv_worker.fetched == {}  # type: ignore[attr-defined]
    producer.engine.shutdown()
    consumer.engine.shutdown()


def _tensors_in(value: object, depth: int = 0) -> bool:
    """Whether a tensor is in `value`, its containers' items or its plain attributes (up to
    three levels: the scheduler side's own state, not the executor or the pool it points to)."""
    import torch

    if isinstance(value, torch.Tensor):
        return True
    if depth == 3:
        return False
    if isinstance(value, dict):
        return any(_tensors_in(v, depth + 1) for v in value.values())
    if isinstance(value, (list, tuple, set)):
        return any(_tensors_in(v, depth + 1) for v in value)
    return False


def test_a_decode_instance_that_preempts(
    tiny_weights_dir: Callable[[str], str], colocated: list[RequestOutput]
) -> None:
    """A decode pool of 24 blocks: requests continued from transferred blocks are preempted
    and recomputed (from their prefix-cache hits where those survive), with the same outputs."""
    folder, port = tiny_weights_dir("llama"), _free_port()
    producer = LLM(folder, kv_transfer_config=_kv("kv_producer", port), **ENGINE)
    small = {**ENGINE, "num_gpu_blocks_override": 24}
    consumer = LLM(folder, kv_transfer_config=_kv("kv_consumer", _free_port()), **small)
    _prefill(producer)
    assert_same_outputs(_decode(consumer, port), colocated)
    stats = consumer.engine.stats()
    assert stats.num_preemptions > 0 and stats.kv_transfer["blocks_received"] > 0
    producer.engine.shutdown()
    consumer.engine.shutdown()


@pytest.mark.slow
def test_smollm2_disaggregated_equals_colocated(smollm2_path: str) -> None:
    """The shipped GGUF, kept quantized: prompts of several blocks, greedy."""
    prompts = [
        "The history of the printing press begins with movable type in East Asia, long before "
        "Gutenberg built his press in Mainz around 1440. It changed",
        "Write a haiku about rain falling on a quiet city at night, then explain its imagery "
        "line by line for a reader who is new to poetry.",
    ]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)
    pool = {"num_gpu_blocks_override": 128, "block_size": 16}
    want = LLM(**pool).generate(prompts, params, use_tqdm=False)
    port = _free_port()
    producer = LLM(kv_transfer_config=_kv("kv_producer", port), **pool)
    consumer = LLM(kv_transfer_config=_kv("kv_consumer", _free_port()), **pool)
    producer.generate(prompts, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    remote = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": port}
    got = consumer.generate(
        [{"prompt": p, "kv_transfer_params": remote} for p in prompts], params, use_tqdm=False
    )
    assert_same_outputs(got, want)
    assert consumer.engine.stats().kv_transfer["blocks_received"] > 0
    producer.engine.shutdown()
    consumer.engine.shutdown()


def test_a_failed_fetch_is_retried_then_computed_locally(
    tiny_weights_dir: Callable[[str], str], colocated: list[RequestOutput]
) -> None:
    """Nothing listens at the producer's address: each fetch times out twice (one retry), and
    the consumer computes the prompts itself, with the same outputs."""
    kv = _kv("kv_consumer", _free_port(), timeout_s=0.2, retries=1)
    consumer = LLM(tiny_weights_dir("llama"), kv_transfer_config=kv, **ENGINE)
    got = _decode(consumer, _free_port())
    assert_same_outputs(got, colocated)
    stats = consumer.engine.stats().kv_transfer
    assert stats["fetch_failures"] == stats["fetches"] > 0
    assert stats["fetch_retries"] == stats["fetches"]
    assert stats["blocks_received"] == 0
    consumer.engine.shutdown()


def test_a_producer_that_lost_the_blocks_sends_what_it_has(
    tiny_weights_dir: Callable[[str], str], colocated: list[RequestOutput]
) -> None:
    """A producer that never computed the prompts (or evicted them) answers with no blocks:
    not a failure, and the consumer computes the prompts."""
    folder, port = tiny_weights_dir("llama"), _free_port()
    producer = LLM(folder, kv_transfer_config=_kv("kv_producer", port), **ENGINE)
    consumer = LLM(folder, kv_transfer_config=_kv("kv_consumer", _free_port()), **ENGINE)
    assert_same_outputs(_decode(consumer, port), colocated)
    stats = consumer.engine.stats().kv_transfer
    assert stats["fetch_failures"] == 0 and stats["blocks_received"] == 0
    producer.engine.shutdown()
    consumer.engine.shutdown()


@pytest.mark.slow  # the default suite refuses through a failing producer (below)
def test_mismatched_caches_are_refused_and_computed_locally(
    tiny_weights_dir: Callable[[str], str],
) -> None:
    """A producer with another block size has other hashes and another layout: refused."""
    folder, port = tiny_weights_dir("llama"), _free_port()
    producer = LLM(
        folder, kv_transfer_config=_kv("kv_producer", port), **{**ENGINE, "block_size": 16}
    )
    _prefill(producer)
    kv = _kv("kv_consumer", _free_port(), timeout_s=2.0, retries=0)
    consumer = LLM(folder, kv_transfer_config=kv, **ENGINE)
    want = LLM(folder, **ENGINE).generate(
        [{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False
    )
    assert_same_outputs(_decode(consumer, port), want)
    stats = consumer.engine.stats().kv_transfer
    assert stats["fetch_failures"] == stats["fetches"] > 0
    producer.engine.shutdown()
    consumer.engine.shutdown()


@pytest.mark.slow  # the default suite serves under the engine's lock (the staging test)
def test_the_producer_serves_while_it_steps(tiny_weights_dir: Callable[[str], str]) -> None:
    """The KV server thread reads under the engine's lock: fetches answered while the producer
    runs other requests get whole blocks (the outputs still match)."""
    folder, port = tiny_weights_dir("llama"), _free_port()
    roomy = {**ENGINE, "num_gpu_blocks_override": 256}  # the other requests evict nothing
    producer = LLM(folder, kv_transfer_config=_kv("kv_producer", port), **roomy)
    consumer = LLM(folder, kv_transfer_config=_kv("kv_consumer", _free_port()), **ENGINE)
    want = LLM(folder, **ENGINE).generate(
        [{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False
    )
    _prefill(producer)
    busy = SamplingParams(max_tokens=64, ignore_eos=True, temperature=0)
    background = threading.Thread(
        target=producer.generate,
        args=([{"prompt_token_ids": [7] * 30}] * 4, busy),
        kwargs={"use_tqdm": False},
    )
    background.start()
    got = _decode(consumer, port)
    background.join()
    assert_same_outputs(got, want)
    assert consumer.engine.stats().kv_transfer["blocks_received"] > 0
    producer.engine.shutdown()
    consumer.engine.shutdown()


@pytest.mark.parametrize(
    "config,match",
    [
        ({"kv_connector": "NixlConnector", "kv_role": "kv_producer"}, "kv_connector must be"),
        ({"kv_connector": "PagodaConnector", "kv_role": "prefill"}, "kv_role must be"),
        ({"kv_connector": "PagodaConnector"}, "needs kv_role"),
        ('{"kv_connector": ', "not valid JSON"),
        ({"kv_connector": "PagodaConnector", "kv_role": "kv_both", "x": 1}, "unknown field"),
        (_kv("kv_consumer", 1, timeout_s=0), "timeout_s must be > 0"),
    ],
)
def test_bad_kv_transfer_configs_are_value_errors(config: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LLM(kv_transfer_config=config, skip_tokenizer_init=True)


def test_bad_kv_transfer_params_are_value_errors(tiny_weights_dir: Callable[[str], str]) -> None:
    consumer = LLM(
        tiny_weights_dir("llama"), kv_transfer_config=_kv("kv_consumer", _free_port()), **ENGINE
    )
    bad = {"do_remote_prefill": True, "remote_host": "127.0.0.1"}
    with pytest.raises(ValueError, match="remote_port"):
        consumer.generate([{"prompt_token_ids": [1, 2, 3], "kv_transfer_params": bad}])
    consumer.engine.shutdown()


def test_every_configurable_connector_has_an_implementation() -> None:
    from pagoda.distributed.kv_transfer import CONNECTORS
    from pagoda.kv_transfer_config import KV_CONNECTORS

    assert set(KV_CONNECTORS) == set(CONNECTORS)


def test_blocks_staged_at_finish_are_served_while_the_producer_is_busy(
    tiny_weights_dir: Callable[[str], str], colocated: list[RequestOutput]
) -> None:
    """Prompts that asked for remote decode (do_remote_decode, as the proxy sends them) are
    copied out when they finish: their fetches are answered even while the producer's engine
    holds its lock (mid-step), which an unstaged fetch would wait for until it timed out."""
    folder, port = tiny_weights_dir("llama"), _free_port()
    producer = LLM(folder, kv_transfer_config=_kv("kv_producer", port), **ENGINE)
    kv = _kv("kv_consumer", _free_port(), timeout_s=1.0, retries=0)
    consumer = LLM(folder, kv_transfer_config=kv, **ENGINE)
    one = SamplingParams(max_tokens=1, temperature=0)
    asked = {"do_remote_decode": True}
    producer.generate(
        [{"prompt_token_ids": p, "kv_transfer_params": asked} for p in PROMPTS], one, use_tqdm=False
    )
    with producer.engine.lock:  # the producer is in the middle of a step
        got = _decode(consumer, port)
    assert_same_outputs(got, colocated)
    stats = consumer.engine.stats().kv_transfer
    assert stats["fetch_failures"] == 0 and stats["blocks_received"] > 0
    producer.engine.shutdown()
    consumer.engine.shutdown()


def test_a_failing_producer_answers_with_its_error_and_keeps_serving(
    tiny_weights_dir: Callable[[str], str], colocated: list[RequestOutput]
) -> None:
    """An exception in the producer's read is answered as an error (the consumer computes the
    prompt) and logged; the server thread lives on and answers the next fetches."""
    folder, port = tiny_weights_dir("llama"), _free_port()
    producer = LLM(folder, kv_transfer_config=_kv("kv_producer", port), **ENGINE)
    kv = _kv("kv_consumer", _free_port(), timeout_s=2.0, retries=1)
    consumer = LLM(folder, kv_transfer_config=kv, **ENGINE)
    _prefill(producer)
    server: Any = producer.engine.executor.kv_worker.connector.server  # type: ignore[attr-defined]

    def broken(hashes: list[bytes]) -> list[Any]:
        raise RuntimeError("disk on fire")

    server.read_blocks = broken
    assert_same_outputs(_decode(consumer, port), colocated)
    stats = consumer.engine.stats().kv_transfer
    assert stats["fetch_failures"] == stats["fetches"] > 0
    assert stats["fetch_retries"] == stats["fetches"]
    # every try (a first and a retry per fetch) was answered by the server, none timed out
    assert producer.engine.stats().kv_transfer["fetches_served"] == 2 * stats["fetches"]
    assert server.thread.is_alive()
    producer.engine.shutdown()
    consumer.engine.shutdown()
