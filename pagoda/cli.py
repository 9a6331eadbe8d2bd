"""`pagoda serve | generate | chat | bench | proxy`: engine flags are named as vLLM names them."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from pagoda.client.reasoning import REASONING_PARSERS
from pagoda.engine_args import add_engine_args, engine_kwargs
from pagoda.sampling_params import SamplingParams


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.7)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--n", type=int, default=1)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--logprobs", type=int, default=None)
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")


def sampling_params_from(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        n=args.n,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        logprobs=args.logprobs,
        seed=args.sampling_seed,
    )


def _cmd_generate(args: argparse.Namespace) -> int:
    from pagoda.client.llm import LLM

    llm = LLM(args.model, **engine_kwargs(args))
    params = sampling_params_from(args)
    prompts = args.prompt or [sys.stdin.read()]
    if args.chat:
        outputs = llm.chat(
            [[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False
        )
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    for out in outputs:
        for c in out.outputs:
            if args.json:
                record = {
                    "prompt": out.prompt,
                    "index": c.index,
                    "text": c.text,
                    "token_ids": c.token_ids,
                    "finish_reason": c.finish_reason,
                    "num_cached_tokens": out.num_cached_tokens,
                }
                print(json.dumps(record))
            else:
                print(c.text)
    return 0


def _cmd_chat(args: argparse.Namespace) -> int:
    from pagoda.client.llm import LLM

    llm = LLM(args.model, **engine_kwargs(args))
    params = sampling_params_from(args)
    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    print("pagoda chat: type a message, an empty line or Ctrl-D to quit.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        history.append({"role": "user", "content": line})
        reply = []
        for delta in llm.chat_stream(history, params):
            reply.append(delta)
            print(delta, end="", flush=True)
        print()
        history.append({"role": "assistant", "content": "".join(reply)})
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from pagoda.config import EngineConfig

    if args.model_tag is not None and args.model is not None and args.model_tag != args.model:
        raise ValueError("give the model once: as the positional MODEL or as --model")
    if args.max_waiting_requests is not None and args.max_waiting_requests < 0:
        raise ValueError("--max-waiting-requests must be >= 0")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes)")
    if args.skip_tokenizer_init:
        raise ValueError(
            "pagoda serve needs a tokenizer (its API takes and returns text), so it does not take "
            "--skip-tokenizer-init; give a model with tokenizer files or --tokenizer PATH "
            "(token-id-only runs: LLM(..., skip_tokenizer_init=True), pagoda bench throughput / "
            "latency)"
        )
    engine_config = EngineConfig.from_kwargs(args.model_tag or args.model, **engine_kwargs(args))
    if args.ray:
        from pagoda.scaleout.ray_serve import run_on_ray

        return run_on_ray(engine_config, server_config(args), ray_options(args), args.ray_address)
    # The engine process starts loading the model (and a thread the tokenizer) now, while this
    # process imports the server (FastAPI, uvicorn: most of a second).
    from pagoda.client.async_client import launch_engine

    launch = launch_engine(engine_config)
    try:
        from pagoda.server.app import run_server

        return run_server(engine_config, server_config(args), launch)
    finally:
        launch.kill()


def server_config(args: argparse.Namespace) -> Any:
    """ServerConfig from `pagoda serve`'s flags."""
    from pagoda.server.lora_models import parse_lora_module, runtime_updating_allowed
    from pagoda.server.state import ServerConfig

    return ServerConfig(
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        served_model_name=args.served_model_name,
        max_waiting_requests=args.max_waiting_requests,
        shutdown_timeout=args.shutdown_timeout,
        log_requests=not args.disable_log_requests,
        log_stats_interval=0.0 if args.disable_log_stats else args.log_stats_interval,
        uvicorn_log_level=args.uvicorn_log_level,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        lora_modules=tuple(parse_lora_module(m) for m in args.lora_modules or ()),
        allow_runtime_lora_updating=runtime_updating_allowed(),
    )


def ray_options(args: argparse.Namespace) -> Any:
    """RayServeOptions from `pagoda serve --ray`'s flags."""
    from pagoda.scaleout.autoscaling import SLOPolicyConfig
    from pagoda.scaleout.ray_serve import RayServeOptions

    if args.num_replicas is not None and (args.min_replicas or args.max_replicas):
        raise ValueError("give --num-replicas, or --min-replicas and --max-replicas, not both")
    low = args.num_replicas or args.min_replicas or 1
    high = args.num_replicas or args.max_replicas or low
    return RayServeOptions(
        min_replicas=low,
        max_replicas=high,
        router=args.ray_router,
        replica_num_cpus=args.replica_num_cpus,
        replica_num_gpus=args.replica_num_gpus,
        slo=SLOPolicyConfig(ttft_slo_s=args.ttft_slo, tpot_slo_s=args.tpot_slo),
    )


def _cmd_proxy(args: argparse.Namespace) -> int:
    from pagoda.server.proxy import ProxyConfig, run_proxy

    config = ProxyConfig(
        args.prefill, args.decode, args.host, args.port, args.timeout, args.min_prefill_tokens
    )
    return run_proxy(config)


def _add_proxy_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--prefill",
        action="append",
        required=True,
        help="base URL of a prefill instance, a kv_producer (repeatable)",
    )
    parser.add_argument(
        "--decode",
        action="append",
        required=True,
        help="base URL of a decode instance, a kv_consumer (repeatable)",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="seconds an instance may take to answer"
    )
    parser.add_argument(
        "--min-prefill-tokens",
        type=int,
        default=0,
        help="prompts shorter than this go straight to a decode instance (0: every prompt "
        "goes through a prefill instance, as vLLM's proxy does)",
    )


# `pagoda serve`'s own flags, as ENGINE_FLAGS: (their names, argparse's options).
Flags = tuple[tuple[tuple[str, ...], dict[str, Any]], ...]

SERVER_FLAGS: Flags = (
    (("--host",), dict(default="127.0.0.1")),
    (("--port",), dict(type=int, default=8000)),
    (("--api-key",), dict(default=None, help="require 'Authorization: Bearer KEY' on /v1")),
    (("--served-model-name",), dict(default=None, help="model name in the API")),
    (
        ("--max-waiting-requests",),
        dict(
            type=int,
            default=None,
            help="answer 429 while this many requests wait in the queue (default: no limit)",
        ),
    ),
    (
        ("--shutdown-timeout",),
        dict(
            type=float,
            default=30.0,
            help="on SIGTERM, seconds to let in-flight requests finish",
        ),
    ),
    (
        ("--enable-auto-tool-choice",),
        dict(
            action="store_true",
            help='let the model call tools on its own (tool_choice "auto"); needs --tool-call-parser',
        ),
    ),
    (
        ("--tool-call-parser",),
        dict(
            default=None,
            choices=["hermes"],
            help="how tool calls are read from the output: hermes (<tool_call> JSON, Qwen2.5's "
            "format; a template without tools gets it in its system prompt)",
        ),
    ),
    (
        ("--reasoning-parser",),
        dict(
            default=None,
            choices=REASONING_PARSERS,
            help="split <think>...</think> from the answer into message.reasoning_content (and "
            "reasoning); grammars apply after </think>",
        ),
    ),
    (
        ("--lora-modules",),
        dict(
            nargs="+",
            default=None,
            metavar="NAME=PATH",
            help="LoRA adapters served from the start (with --enable-lora): name=path of a PEFT "
            'folder or GGUF LoRA, or JSON {"name": ..., "path": ...}; a request names one as '
            "its model. PAGODA_ALLOW_RUNTIME_LORA_UPDATING=true adds /v1/load_lora_adapter and "
            "/v1/unload_lora_adapter",
        ),
    ),
    (("--disable-log-requests",), dict(action="store_true")),
    (("--disable-log-stats",), dict(action="store_true")),
    (("--log-stats-interval",), dict(type=float, default=10.0)),
    (
        ("--uvicorn-log-level",),
        dict(default="info", choices=["critical", "error", "warning", "info", "debug", "trace"]),
    ),
)

RAY_FLAGS: Flags = (
    (
        ("--ray",),
        dict(
            action="store_true",
            help="serve replicas of the engine on Ray Serve behind this host and port",
        ),
    ),
    (("--ray-address",), dict(default=None, help="Ray cluster (default: RAY_ADDRESS or local)")),
    (("--num-replicas",), dict(type=int, default=None, help="fixed replica count")),
    (("--min-replicas",), dict(type=int, default=None, help="autoscaling: warm minimum")),
    (("--max-replicas",), dict(type=int, default=None, help="autoscaling: maximum")),
    (("--ttft-slo",), dict(type=float, default=1.0, help="autoscaling: TTFT SLO, seconds")),
    (("--tpot-slo",), dict(type=float, default=0.1, help="autoscaling: TPOT SLO, seconds")),
    (
        ("--ray-router",),
        dict(
            default="prefix",
            choices=["prefix", "power-of-two"],
            help="replica choice: prompt-prefix affinity (default) or Ray's power of two choices",
        ),
    ),
    (
        ("--replica-num-cpus",),
        dict(type=float, default=1.0, help="CPUs Ray reserves per replica"),
    ),
    (
        ("--replica-num-gpus",),
        dict(type=float, default=0.0, help="GPUs Ray reserves per replica"),
    ),
)


def _add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL")
    groups = (
        ("server", SERVER_FLAGS),
        ("Ray Serve (scale-out; needs the `ray` extra)", RAY_FLAGS),
    )
    for title, flags in groups:
        group = parser.add_argument_group(title)
        for names, options in flags:
            group.add_argument(*names, **options)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagoda", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate completions for prompts")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.add_argument("--prompt", action="append", help="prompt (repeatable; default: stdin)")
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON line per output")
    gen.set_defaults(func=_cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat, streaming tokens to the terminal")
    add_engine_args(chat)
    add_sampling_args(chat)
    chat.add_argument("--system", default=None, help="system message")
    chat.set_defaults(func=_cmd_chat)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(serve)
    _add_serve_args(serve)
    serve.set_defaults(func=_cmd_serve)

    proxy = sub.add_parser(
        "proxy",
        help="prefill/decode disaggregation: route each request to a prefill instance, then to "
        "a decode instance that continues from its KV",
    )
    _add_proxy_args(proxy)
    proxy.set_defaults(func=_cmd_proxy)

    bench = sub.add_parser("bench", help="benchmarks (print one JSON line)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    from pagoda.bench import interference, latency, throughput
    from pagoda.bench import serve as bench_serve

    for module in (throughput, latency):
        p = bench_sub.add_parser(module.NAME, help=module.__doc__)
        add_engine_args(p)
        module.add_arguments(p)
        p.set_defaults(func=module.main)
    # `bench serve` and `bench interference` drive a running server: no engine flags.
    for module in (bench_serve, interference):
        p = bench_sub.add_parser(module.NAME, help=module.__doc__)
        module.add_arguments(p)
        p.set_defaults(func=module.main)

    from pagoda.bench import plan

    planner = sub.add_parser("plan", help="capacity plan: batch size, max rate, cost per 1K tokens")
    plan.add_arguments(planner)
    planner.set_defaults(func=plan.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request (bench, plan)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
