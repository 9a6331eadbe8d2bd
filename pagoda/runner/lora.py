"""The adapter slots of one rank's model: which LoRA adapter each slot holds, which slot each
token of a step reads, and the loading, checking and eviction of adapters.

`LoRATable` gives every decoder projection a `LoRAWeights` (layers/lora.py) of `max_loras`
slots of rank `max_lora_rank`, and one shared token -> slot index. An adapter is read and
checked against the model when the engine first sees it (`add`: a ValueError then, and the
engine goes on), cut to this rank's share of each layer and scaled, and kept on the host
(at most `max_cpu_loras`, least recently used dropped first). A step's adapters are copied into
slots before its forward (`prepare`); a slot whose adapter no running request uses is taken
back least recently used first. The scheduler admits at most `max_loras` distinct adapters
among its running requests, so a step always finds its slots.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import nn

from pagoda.layers.linear import Linear, MergedLinear
from pagoda.layers.lora import LoRAWeights
from pagoda.loading.lora import LoRAAdapter, load_adapter
from pagoda.lora_request import LoRARequest
from pagoda.scheduling.messages import SchedulerOutput


@dataclass(frozen=True)
class Target:
    """Where an HF module's adapter goes: a layer and the slices (shard ids) it covers."""

    name: str  # the layer's module name
    layer: Linear
    shards: tuple[str | None, ...]  # None: a plain Linear's one slice


# (layer, slice index) -> (A cut to this rank (r, in), B cut and scaled (out, r))
Placed = dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]]


class LoRATable:
    def __init__(
        self,
        model: nn.Module,
        packed_modules: tuple[tuple[str, str, str], ...],
        max_loras: int,
        max_rank: int,
        max_cpu_loras: int,
        max_tokens: int,
        device: torch.device,
        dtype: torch.dtype,
        heads: tuple[int, int],
        gguf_archs: tuple[str, ...],
    ) -> None:
        """heads: the model's (num_attention_heads, num_key_value_heads), which a GGUF adapter's
        q/k rows need (loading/lora_gguf.py); gguf_archs: the GGUF architectures of its family
        (a GGUF adapter of another is refused)."""
        self.max_loras, self.max_rank, self.max_cpu_loras = max_loras, max_rank, max_cpu_loras
        self.heads, self.gguf_archs = heads, gguf_archs
        # The step's token -> slot index; -1: the base model alone (and padding rows).
        self.token_slots = torch.full((max_tokens,), -1, dtype=torch.int64, device=device)
        self.layers: dict[str, Linear] = {}
        self.targets: dict[str, Target] = {}
        for name, module in model.named_modules():
            if isinstance(module, Linear) and ".layers." in f".{name}":
                self._attach(name, module, packed_modules, dtype)
        # Read adapters on the host, least recently used first; `known` keeps every added one,
        # to read again after the host cache dropped it.
        self.adapters: OrderedDict[int, tuple[LoRARequest, Placed]] = OrderedDict()
        self.known: dict[int, LoRARequest] = {}
        self.slot_ids = [0] * max_loras  # the adapter id each slot holds; 0: none
        self.last_used = [0] * max_loras
        self.rows: dict[str, int] = {}  # request id -> adapter id (0: none), running requests
        self.steps = 0

    def _attach(
        self, name: str, layer: Linear, packed: tuple[tuple[str, str, str], ...], dtype: torch.dtype
    ) -> None:
        shards: tuple[str | None, ...] = (None,)
        offsets = [0, layer.output_size]
        if isinstance(layer, MergedLinear):
            shards = tuple(layer.output_sizes)
            offsets = [layer.shard_offsets[s] for s in layer.output_sizes] + [layer.output_size]
        layer.lora = LoRAWeights(
            self.max_loras, offsets, self.max_rank, layer.input_size, self.token_slots, dtype
        )
        self.layers[name] = layer
        # the layer under its own name: every slice
        self.targets[name] = Target(name, layer, shards)
        prefix, _, leaf = name.rpartition(".")
        for packed_name, hf_proj, shard in packed:
            if leaf == packed_name and shard in shards:
                self.targets[f"{prefix}.{hf_proj}"] = Target(name, layer, (shard,))

    # -- adapters on the host --

    def add(self, request: LoRARequest) -> None:
        """Read and check the adapter, keep this rank's share of it. ValueError when the file
        is not an adapter, or does not fit this model or the table's rank."""
        held = self.adapters.get(request.lora_int_id)
        if held is not None and held[0] == request:
            self.adapters.move_to_end(request.lora_int_id)
            self.known[request.lora_int_id] = request
            return
        if held is not None and request.lora_int_id in self.rows.values():
            raise ValueError(
                f"lora_int_id {request.lora_int_id} is still in use by running requests"
            )
        adapter = load_adapter(request.lora_path, self.heads)
        if adapter.architecture is not None and adapter.architecture not in self.gguf_archs:
            raise ValueError(
                f"LoRA adapter {request.lora_name!r} was converted for a "
                f"{adapter.architecture!r} model; this base model is {', '.join(self.gguf_archs)}"
            )
        if adapter.rank > self.max_rank:
            raise ValueError(
                f"LoRA adapter {request.lora_name!r} has rank {adapter.rank}, above "
                f"--max-lora-rank {self.max_rank}"
            )
        placed = self._place(request.lora_name, adapter)
        self.remove(request.lora_int_id)
        while len(self.adapters) >= self.max_cpu_loras:
            if not self._drop_host_lru():
                break
        self.adapters[request.lora_int_id] = (request, placed)
        self.known[request.lora_int_id] = request

    def _drop_host_lru(self) -> bool:
        """Drop the least recently used host adapter that no slot or running request holds."""
        in_use = set(self.slot_ids) | set(self.rows.values())
        for lora_id in self.adapters:
            if lora_id not in in_use:
                del self.adapters[lora_id]
                return True
        return False

    def remove(self, lora_id: int) -> bool:
        """Forget an adapter: no new request may use it; its running requests keep it (its
        slot and host copy go when they have ended). False when it was not added."""
        if self.known.pop(lora_id, None) is None:
            return False
        self._retire(lora_id)
        return True

    def _retire(self, lora_id: int) -> None:
        """Drop a removed adapter's host copy and slot once no running request uses it."""
        if lora_id in self.known or lora_id in self.rows.values():
            return
        self.adapters.pop(lora_id, None)
        for slot, held in enumerate(self.slot_ids):
            if held == lora_id:
                self._clear(slot)

    def _place(self, name: str, adapter: LoRAAdapter) -> Placed:
        placed: Placed = {}
        for module, (a, b) in adapter.weights.items():
            target = self.targets.get(module)
            if target is None:
                supported = sorted({n.rpartition(".")[2] for n in self.targets})
                raise ValueError(
                    f"LoRA adapter {name!r} targets {module}, which this model has no LoRA "
                    f"layer for (supported modules: {', '.join(supported)})"
                )
            layer_name = target.name
            for shard, (sa, sb) in _split(target, a, b).items():
                ca, cb = _cut(target.layer, shard, sa, sb, name, module)
                index = target.layer.lora_slice(shard)
                cb = cb * adapter.scaling[module]
                if (layer_name, index) in placed:
                    raise ValueError(
                        f"LoRA adapter {name!r} names {module}'s projection twice (whole and "
                        "by shard)"
                    )
                placed[(layer_name, index)] = (ca, cb)
        return placed

    # -- slots, each step --

    def track(self, out: SchedulerOutput) -> None:
        """The step's deltas: which adapter each running request uses."""
        for rid in out.finished_request_ids + out.preempted_request_ids:
            lora_id = self.rows.pop(rid, 0)
            if lora_id and lora_id not in self.known:
                self._retire(lora_id)
        for new in out.new_requests:
            self.rows[new.request_id] = new.lora_id

    def prepare(self, rids: list[str], counts: list[int], pad_to: int | None = None) -> None:
        """Write the step's token -> slot index: rows `rids` with `counts` tokens each, in
        flat-batch order (and -1 up to pad_to), loading their adapters into slots first."""
        self.steps += 1
        slot_of: dict[int, int] = {0: -1}
        for lora_id in {self.rows.get(rid, 0) for rid in rids} - {0}:
            slot_of[lora_id] = self._slot_for(lora_id)
        slots = [slot_of[self.rows.get(rid, 0)] for rid in rids]
        total = sum(counts)
        host = torch.tensor(slots, dtype=torch.int64).repeat_interleave(torch.tensor(counts))
        self.token_slots[:total].copy_(host, non_blocking=True)
        end = max(pad_to or 0, total)
        if end > total:
            self.token_slots[total:end].fill_(-1)

    def _slot_for(self, lora_id: int) -> int:
        if lora_id in self.slot_ids:
            slot = self.slot_ids.index(lora_id)
        else:
            slot = self._free_slot()
            self._load(slot, lora_id)
        self.last_used[slot] = self.steps
        return slot

    def _free_slot(self) -> int:
        """An empty slot, else the least recently used one no running request's adapter holds."""
        if 0 in self.slot_ids:
            return self.slot_ids.index(0)
        running = set(self.rows.values())
        free = [s for s, held in enumerate(self.slot_ids) if held not in running]
        if not free:
            raise RuntimeError(
                f"more than --max-loras {self.max_loras} adapters among the running requests: "
                "the scheduler admits at most that many"
            )
        return min(free, key=lambda s: self.last_used[s])

    def _load(self, slot: int, lora_id: int) -> None:
        if lora_id not in self.adapters:  # dropped from the host cache: read it again
            if lora_id not in self.known:
                raise RuntimeError(f"LoRA adapter {lora_id} was never added (add_lora first)")
            self.add(self.known[lora_id])
        self._clear(slot)
        _, placed = self.adapters[lora_id]
        for (layer_name, index), (a, b) in placed.items():
            weights = self.layers[layer_name].lora
            assert weights is not None
            o0, o1 = weights.offsets[index], weights.offsets[index + 1]
            rank = a.shape[0]
            weights.a[slot, index, :rank].copy_(a)
            weights.b[slot, o0:o1, :rank].copy_(b)
        self.slot_ids[slot] = lora_id

    def _clear(self, slot: int) -> None:
        for layer in self.layers.values():
            assert layer.lora is not None
            layer.lora.clear(slot)
        self.slot_ids[slot] = 0


def _split(
    target: Target, a: torch.Tensor, b: torch.Tensor
) -> dict[str | None, tuple[torch.Tensor, torch.Tensor]]:
    """An adapter of a whole packed layer (B over every shard's rows) as one per shard; the
    shards share A."""
    if target.shards == (None,) or len(target.shards) == 1:
        return {target.shards[0]: (a, b)}
    layer = target.layer
    assert isinstance(layer, MergedLinear)
    if layer.out_parts is not None:
        raise ValueError(
            "an adapter of a whole packed layer is not supported under tensor parallelism"
        )
    return {
        s: (a, b.narrow(0, layer.shard_offsets[s], layer.output_sizes[s]))
        for s in layer.output_sizes
    }


def _cut(
    layer: Linear, shard: str | None, a: torch.Tensor, b: torch.Tensor, name: str, module: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share: A's input columns (row-parallel) or B's output rows (column-
    parallel); ValueError when the adapter's shapes are not the model's."""
    out_size = (
        layer.output_sizes[shard]
        if isinstance(layer, MergedLinear) and shard
        else layer.output_size
    )
    in_ok = (
        a.shape[1] == layer.input_size
        if layer.in_part is None
        else a.shape[1] >= sum(layer.in_part)
    )
    out_parts = layer.out_parts
    part = None if out_parts is None else out_parts[shard]
    out_ok = b.shape[0] == out_size if part is None else b.shape[0] >= sum(part)
    if not (in_ok and out_ok):
        raise ValueError(
            f"LoRA adapter {name!r} does not fit this base model: {module} has A "
            f"{tuple(a.shape)} and B {tuple(b.shape)}, the model's layer maps "
            f"{layer.input_size} inputs to {out_size} outputs per rank (was it trained on "
            "another base model?)"
        )
    if layer.in_part is not None:
        a = a.narrow(1, *layer.in_part)
    if part is not None:
        b = b.narrow(0, *part)
    return a.contiguous(), b.contiguous()
