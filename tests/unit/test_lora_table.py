"""The LoRA adapter slots (runner/lora.py) on a two-layer model of pagoda's projections, with
adapters written as PEFT writes them: what is checked when an adapter is added, the products a
step's tokens get, LRU eviction of slots no running request uses and of host copies, removal
while requests still run; and the scheduler's max_loras admission with its wait reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from pagoda.config import SchedulerConfig
from pagoda.layers.linear import Linear, MergedLinear
from pagoda.lora_request import LoRARequest
from pagoda.runner.lora import LoRATable
from pagoda.sampling_params import SamplingParams
from pagoda.scheduling.block_pool import BlockPool
from pagoda.scheduling.kv_cache_manager import KVCacheManager
from pagoda.scheduling.messages import NewRequestData, SchedulerOutput
from pagoda.scheduling.request import Request
from pagoda.scheduling.scheduler import Scheduler

HIDDEN, KV, INTER = 8, 4, 12
PACKED = (("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"))


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv_proj = MergedLinear(HIDDEN, {"q": HIDDEN, "k": KV, "v": KV})
        self.o_proj = Linear(HIDDEN, HIDDEN)


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn = _Attention()
        self.down_proj = Linear(INTER, HIDDEN)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([_Layer(), _Layer()])


def _table(max_loras: int = 2, max_cpu_loras: int = 4, max_rank: int = 8) -> LoRATable:
    model = _Model()
    return LoRATable(
        model, PACKED, max_loras, max_rank, max_cpu_loras, 16, torch.device("cpu"),
        torch.float32, (2, 1), ("llama",),
    )  # fmt: skip


def _adapter(
    folder: Path, rank: int, seed: int, modules: dict[str, tuple[int, int]] | None = None
) -> str:
    """A PEFT folder: A (r, in), B (out, r) per module, alpha = 2 r (scaling 2)."""
    modules = modules or {"self_attn.q_proj": (HIDDEN, HIDDEN), "self_attn.v_proj": (HIDDEN, KV)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(2):
        for module, (fan_in, fan_out) in modules.items():
            name = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen)
            tensors[f"{name}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen)
    folder.mkdir()
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": []}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return str(folder)


def _step(table: LoRATable, new: dict[str, int], finished: tuple[str, ...] = ()) -> None:
    """A step's deltas: new requests with their adapter ids, finished ones."""
    sp = SamplingParams()
    reqs = [NewRequestData(rid, [1], [], sp, [], lora_id=i) for rid, i in new.items()]
    table.track(SchedulerOutput(0, [], new_requests=reqs, finished_request_ids=list(finished)))


def test_a_step_adds_each_tokens_adapter_product(tmp_path: Path) -> None:
    table = _table()
    path = _adapter(tmp_path / "a", rank=4, seed=0)
    table.add(LoRARequest("a", 1, path))
    _step(table, {"r0": 1, "r1": 0})
    table.prepare(["r0", "r1"], [2, 1])
    assert table.token_slots[:3].tolist() == [0, 0, -1]
    layer = table.layers["model.layers.1.self_attn.qkv_proj"]
    x = torch.randn(3, HIDDEN)
    y = torch.zeros(3, 2 * HIDDEN)
    assert layer.lora is not None
    layer.lora.add_to(y, x)
    from safetensors.torch import load_file

    raw = load_file(f"{path}/adapter_model.safetensors")
    prefix = "base_model.model.model.layers.1.self_attn"
    q = 2 * x @ raw[f"{prefix}.q_proj.lora_A.weight"].T @ raw[f"{prefix}.q_proj.lora_B.weight"].T
    v = 2 * x @ raw[f"{prefix}.v_proj.lora_A.weight"].T @ raw[f"{prefix}.v_proj.lora_B.weight"].T
    torch.testing.assert_close(y[:2, :HIDDEN], q[:2], rtol=1e-5, atol=1e-5)
    assert not y[:2, HIDDEN : HIDDEN + KV].any()  # k: not a target
    torch.testing.assert_close(y[:2, HIDDEN + KV :], v[:2], rtol=1e-5, atol=1e-5)
    assert not y[2].any()  # the base model's token


def test_adapters_that_do_not_fit_are_value_errors(tmp_path: Path) -> None:
    table = _table(max_rank=4)
    with pytest.raises(ValueError, match="rank 8, above --max-lora-rank 4"):
        table.add(LoRARequest("big", 1, _adapter(tmp_path / "big", rank=8, seed=0)))
    odd = _adapter(tmp_path / "odd", 2, 0, {"mlp.gate_proj": (HIDDEN, INTER)})
    with pytest.raises(ValueError, match="no LoRA layer for"):
        table.add(LoRARequest("odd", 2, odd))
    wide = _adapter(tmp_path / "wide", 2, 0, {"self_attn.o_proj": (2 * HIDDEN, HIDDEN)})
    with pytest.raises(ValueError, match="another base model"):
        table.add(LoRARequest("wide", 3, wide))
    assert table.adapters == {}


def test_slots_evict_the_least_recently_used_adapter_no_running_request_uses(
    tmp_path: Path,
) -> None:
    table = _table(max_loras=2)
    for i in (1, 2, 3):
        table.add(LoRARequest(f"a{i}", i, _adapter(tmp_path / f"a{i}", 2, i)))
    _step(table, {"r1": 1, "r2": 2})
    table.prepare(["r1"], [1])
    table.prepare(["r2"], [1])  # a1 used before a2
    assert table.slot_ids == [1, 2]
    _step(table, {"r3": 3})
    with pytest.raises(RuntimeError, match="max-loras"):  # both slots' adapters still run
        table.prepare(["r3"], [1])
    _step(table, {}, finished=("r1",))
    table.prepare(["r3"], [1])
    assert table.slot_ids == [3, 2]  # a1's slot: no running request used it
    _step(table, {}, finished=("r2",))
    _step(table, {"r4": 1})
    table.prepare(["r4", "r3"], [1, 1])
    assert table.slot_ids == [3, 1]  # a2's slot now; a3 was used more recently


def test_host_copies_are_dropped_and_read_again(tmp_path: Path) -> None:
    table = _table(max_loras=1, max_cpu_loras=1)
    table.add(LoRARequest("a1", 1, _adapter(tmp_path / "a1", 2, 1)))
    table.add(LoRARequest("a2", 2, _adapter(tmp_path / "a2", 2, 2)))
    assert list(table.adapters) == [2]
    _step(table, {"r1": 1})
    table.prepare(["r1"], [1])  # read again from its path
    assert table.slot_ids == [1] and 1 in table.adapters


def test_a_removed_adapter_stays_until_its_requests_end(tmp_path: Path) -> None:
    table = _table()
    table.add(LoRARequest("a1", 1, _adapter(tmp_path / "a1", 2, 1)))
    _step(table, {"r1": 1})
    table.prepare(["r1"], [1])
    assert table.remove(1) and not table.remove(1)
    table.prepare(["r1"], [1])  # still running with it
    assert table.slot_ids == [1, 0]
    _step(table, {}, finished=("r1",))
    assert table.slot_ids == [0, 0] and table.adapters == {}


def _request(rid: str, lora_id: int, arrival: float) -> Request:
    lora = None if lora_id == 0 else LoRARequest(f"a{lora_id}", lora_id, "/x")
    sp = SamplingParams(max_tokens=4)
    return Request(
        rid,
        [rid.__hash__() % 100 + 1] * 5,
        sp,
        4,
        frozenset({0}),
        arrival,
        0,
        None,
        lora_request=lora,
    )


def test_the_scheduler_runs_at_most_max_loras_adapters() -> None:
    kv = KVCacheManager(BlockPool(64, True), 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8), kv, 256, max_loras=1)
    for i, lora_id in enumerate([1, 2, 0, 1]):
        sched.add_request(_request(f"r{i}", lora_id, float(i)))
    out = sched.schedule()
    assert [s.request_id for s in out.scheduled] == ["r0", "r2", "r3"]
    assert [r.request_id for r in sched.waiting] == ["r1"]
    assert {n.request_id: n.lora_id for n in out.new_requests} == {"r0": 1, "r2": 0, "r3": 1}
    timeline = sched.explainer.explain("r1", sched.step_id)
    assert timeline is not None and "max_loras" in json.dumps(timeline)


def test_two_adapters_hash_the_same_tokens_apart() -> None:
    kv = KVCacheManager(BlockPool(16, True), 4)
    a, b, none = (_request(f"h{i}", i, 0.0) for i in (1, 2, 0))
    for r in (a, b, none):
        r.prompt_token_ids[:] = r.all_token_ids[:] = [7] * 9
    hashes = [kv.block_hashes(r, 2) for r in (a, b, none)]
    assert len({h[0] for h in hashes}) == 3 and len({h[1] for h in hashes}) == 3
    again = _request("h9", 1, 1.0)
    again.prompt_token_ids[:] = again.all_token_ids[:] = [7] * 9
    assert kv.block_hashes(again, 2) == hashes[0]


def test_the_live_views_snapshot_names_each_requests_adapter() -> None:
    from pagoda.scheduling.snapshot import build_snapshot

    kv = KVCacheManager(BlockPool(16, True), 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8), kv, 256, max_loras=2)
    sched.add_request(_request("s1", 1, 0.0))
    sched.add_request(_request("s0", 0, 1.0))
    sched.schedule()
    names = {r.request_id: r.lora_name for r in build_snapshot(sched).requests}
    assert names == {"s1": "a1", "s0": ""}
    assert sched.stats().running_lora_ids == [1]
