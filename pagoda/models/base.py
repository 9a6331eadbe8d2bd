"""What every decoder-only family shares: the stack (embedding, layers, final norm, pipeline
stages) and the causal LM around it (LM head, weight routing, kernel backends). A family file
(llama.py, gemma3.py, ...) provides its decoder layer and, where it differs, its embedding and
rotary angles; models/interface.py is what the loader and the runner see of the result.

Checkpoint tensors arrive under HF names (model.layers.N.self_attn.q_proj.weight, ...); q/k/v
and gate/up are packed into `qkv_proj` and `gate_up_proj` (PACKED_MODULES) and `load_weights`
routes each HF tensor to its slice.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import Any, cast

import torch
from torch import nn

from pagoda.layers.embedding import LMHead, VocabEmbedding
from pagoda.layers.forward_context import ForwardContext
from pagoda.layers.gguf import GGUFWeight
from pagoda.layers.linear import Linear, MergedLinear
from pagoda.layers.norm import RMSNorm
from pagoda.layers.parallel import SINGLE, WHOLE_MODEL, PipelineStage, TensorParallel

# (packed param prefix, HF projection name, shard id)
PACKED_MODULES = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", "gate"),
    ("gate_up_proj", "up_proj", "up"),
)


class MissingLayer(nn.Module):
    """A decoder layer another pipeline stage holds: keeps the layer list's indices (and so the
    checkpoint's names) aligned with the model's."""


class DecoderModel(nn.Module):
    """embed_tokens, layers, norm: the stack without the LM head. A family subclass hands in
    its layers (`make_layer(index, cache_index)`: checkpoint layer `index`, reading this
    stage's KV cache `cache_index`), holds its rotary embedding(s) and overrides `rotary`, and
    `embed` or `make_norm` where its checkpoint differs from Llama's.

    A layer is called as `layer(hidden_states, residual, rope, ctx)` and returns the next
    (hidden_states, residual), the residual stream being their sum (residual None before the
    first layer); `rope` is what `rotary` returned for this step."""

    # Steps of at most this many tokens run the layers' fused forms (`forward_fused`); 0: never.
    # Set by DecoderForCausalLM.set_kernel_backend for families whose layers have them.
    fused_max_rows = 0

    def __init__(
        self,
        config: Any,
        dtype: torch.dtype,
        tp: TensorParallel,
        pp: PipelineStage,
        make_layer: Callable[[int, int], nn.Module],
    ) -> None:
        super().__init__()
        self.dtype = dtype
        self.hidden_size = config.hidden_size
        # This stage's layers [start, end) (all of them without pipeline parallelism); each
        # attention layer indexes the stage's KV caches from 0.
        self.start_layer, self.end_layer = pp.layers(config.num_hidden_layers)
        self.embed_tokens = (
            VocabEmbedding(config.vocab_size, config.hidden_size, dtype, tp)
            if pp.is_first
            else None
        )
        self.layers = nn.ModuleList(
            make_layer(i, i - self.start_layer)
            if self.start_layer <= i < self.end_layer
            else MissingLayer()
            for i in range(config.num_hidden_layers)
        )
        self.norm = self.make_norm(config, dtype) if pp.is_last else None

    def make_norm(self, config: Any, dtype: torch.dtype) -> RMSNorm:
        return RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return cast(VocabEmbedding, self.embed_tokens)(input_ids)

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> Any:
        """What every layer of this step takes as `rope` (Llama: one (cos, sin) pair)."""
        raise NotImplementedError

    def held_layers(self) -> list[nn.Module]:
        return list(self.layers[self.start_layer : self.end_layer])

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext | None = None,
        stream: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """-> (num_tokens, hidden_size) final hidden states; on a pipeline stage before the
        last, the (2, num_tokens, hidden_size) stream the next stage takes as `stream` (a later
        stage given none runs on zeros: warm-up and profiling steps)."""
        residual: torch.Tensor | None = None
        if self.embed_tokens is not None:
            hidden_states = self.embed(input_ids)  # (num_tokens, hidden_size)
        else:
            if stream is None:
                shape = (2, input_ids.shape[0], self.hidden_size)
                stream = torch.zeros(shape, dtype=self.dtype, device=input_ids.device)
            hidden_states, residual = stream[0], stream[1]
        rope = self.rotary(positions, hidden_states.dtype)
        if hidden_states.shape[0] <= self.fused_max_rows:  # a shape: no host sync
            for layer in self.layers:
                hidden_states = cast(Any, layer).forward_fused(hidden_states, rope, ctx)
            assert self.norm is not None  # the fused forms run on the whole model only
            return cast(torch.Tensor, self.norm(hidden_states))
        for layer in self.held_layers():
            hidden_states, residual = layer(hidden_states, residual, rope, ctx)
        assert residual is not None  # every stage holds at least one layer
        if self.norm is None:
            return torch.stack((hidden_states, residual))
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states  # (num_tokens, hidden_size)


class DecoderForCausalLM(nn.Module):
    """The causal LM around a DecoderModel: LM head, weight routing, kernel backends. A family
    builds its stack in `make_model` (and sets `packed_modules` if its checkpoint packs
    differently)."""

    model: DecoderModel
    packed_modules: tuple[tuple[str, str, str], ...] = PACKED_MODULES

    def __init__(
        self,
        hf_config: Any,
        dtype: torch.dtype = torch.float32,
        tp: TensorParallel = SINGLE,
        pp: PipelineStage = WHOLE_MODEL,
    ) -> None:
        """tp: this rank's share of every layer; pp: this stage's layers (the LM head only on
        the last stage)."""
        super().__init__()
        self.config = hf_config
        self.dtype = dtype
        self.tp = tp
        self.pp = pp
        self.model = self.make_model(hf_config, dtype, tp, pp)
        self.lm_head = (
            LMHead(hf_config.vocab_size, hf_config.hidden_size, dtype, tp) if pp.is_last else None
        )
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        # A tied head on a later stage than the embedding loads the embedding's matrix itself.
        embedding = self.model.embed_tokens
        if self.tie_word_embeddings and self.lm_head is not None and embedding is not None:
            self.lm_head.tie_to(embedding)

    def make_model(
        self, hf_config: Any, dtype: torch.dtype, tp: TensorParallel, pp: PipelineStage
    ) -> DecoderModel:
        raise NotImplementedError

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, stream: torch.Tensor | None = None
    ) -> torch.Tensor:
        # input_ids, positions: (num_tokens,) -> hidden states (num_tokens, hidden_size); under
        # pipeline parallelism see DecoderModel.forward for `stream` and a non-last stage's result
        return cast(torch.Tensor, self.model(input_ids, positions, stream=stream))

    def compute_logits(self, hidden_states: torch.Tensor, float32: bool = True) -> torch.Tensor:
        # hidden_states: (n, hidden_size) -> (n, vocab_size) float32 (else the model's dtype)
        if self.lm_head is None:
            raise RuntimeError("only the last pipeline stage holds the LM head")
        return self.lm_head(hidden_states, float32)

    # -- what the loader reads (models/interface.py) --

    def num_held_layers(self) -> int:
        return self.model.end_layer - self.model.start_layer

    def rank_kv_heads(self) -> int:
        """The kv heads this rank's attention layers hold (its share under tensor parallelism)."""
        layer: Any = self.model.layers[self.model.start_layer]
        return int(layer.self_attn.num_kv_heads)

    def vocab_layers(self) -> list[Any]:
        """The embedding and LM head this stage holds."""
        return [m for m in (self.model.embed_tokens, self.lm_head) if m is not None]

    # -- weights --

    def _stage_name(self, name: str) -> str | None:
        """The name checkpoint tensor `name` loads under on this pipeline stage; None when
        another stage holds it (or a tied head reads it from the embedding)."""
        parts = name.split(".")
        if name.startswith("model.layers."):
            held = self.model.start_layer <= int(parts[2]) < self.model.end_layer
            return name if held else None
        if name.startswith("model.embed_tokens."):
            if self.model.embed_tokens is not None:
                return name
            tied_here = self.tie_word_embeddings and self.lm_head is not None
            return "lm_head." + parts[-1] if tied_here else None
        if name.startswith("lm_head."):
            return None if self.tie_word_embeddings or self.lm_head is None else name
        if name.startswith("model.norm."):
            return name if self.model.norm is not None else None
        return name

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """Route HF-named checkpoint tensors to their (packed, possibly quantized) layers.
        Returns what was written, as "<module>.<tensor>" and, for packed layers,
        "<module>.<tensor>:<shard id>" (compare `expected_weights()`). A tensor with no place
        raises ValueError. A tensor may be a GGUF block tensor (layers.gguf.GGUFWeight)."""
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            stage_name = self._stage_name(hf_name)
            if stage_name is None or stage_name.endswith("rotary_emb.inv_freq"):
                continue
            name = stage_name
            shard_id = None
            for packed, hf_proj, shard in self.packed_modules:
                if f".{hf_proj}." in name:
                    name = name.replace(f".{hf_proj}.", f".{packed}.")
                    shard_id = shard
                    break
            module_name, _, tensor_name = name.rpartition(".")
            try:
                module = self.get_submodule(module_name)
            except AttributeError:
                module = None
            if isinstance(module, Linear):
                module.load(tensor_name, tensor, shard_id)
            elif isinstance(module, (VocabEmbedding, LMHead)):
                module.load(tensor, hf_name)
            elif module is not None and isinstance(
                getattr(module, tensor_name, None), nn.Parameter
            ):
                if isinstance(tensor, GGUFWeight):
                    tensor = tensor.dequantize()
                if isinstance(module, RMSNorm):
                    tensor = module.from_checkpoint(tensor)
                _copy_param(getattr(module, tensor_name), tensor, hf_name)
            else:
                raise ValueError(
                    f"checkpoint tensor {hf_name!r} has no parameter in {type(self).__name__}"
                )
            loaded.add(name if shard_id is None else f"{name}:{shard_id}")
        return loaded

    def expected_weights(self) -> set[str]:
        """Names `load_weights` must report for a complete checkpoint."""
        names: set[str] = set()
        for module_name, module in self.named_modules():
            if isinstance(module, Linear):
                tensors = list(module.required_tensors())
                if module.bias is not None:
                    tensors.append("bias")
                shards = list(module.output_sizes) if isinstance(module, MergedLinear) else [None]
                names.update(
                    f"{module_name}.{t}" + ("" if s is None else f":{s}")
                    for t in tensors
                    for s in shards
                )
            else:
                names.update(
                    f"{module_name}.{p}" for p, _ in module.named_parameters(recurse=False)
                )
        if self.lm_head is not None and self.lm_head.tied:
            names.discard("lm_head.weight")
        return names

    def finalize_weights(self) -> None:
        """After loading: every quantized layer builds its stored form."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.finalize()

    # -- kernels --

    def set_kernel_backend(self, backend: str) -> None:
        """Route attention, norms, activations and rotary to "torch" (the reference) or "triton"
        (pagoda/kernels, needs CUDA or TRITON_INTERPRET=1): every module whose class declares a
        `backend` (and a `cpu_kernel`) attribute takes it."""
        cpu_kernel = backend == "torch" and self._cpu_kernels()
        routed: Any
        for routed in self.modules():
            if hasattr(type(routed), "backend"):
                routed.backend = backend
            if hasattr(type(routed), "cpu_kernel"):
                routed.cpu_kernel = cpu_kernel
        self.model.fused_max_rows = 0
        # the fused forms add the residual inside row-parallel projections and keep no separate
        # residual to pass between stages: one rank only
        whole = self.tp.size == 1 and self.pp.size == 1
        fused = all(hasattr(layer, "forward_fused") for layer in self.model.layers)
        if backend == "triton" and fused and self._float_linears() and whole:
            from pagoda.kernels.fused_linear import MAX_ROWS

            self.model.fused_max_rows = MAX_ROWS

    def _cpu_kernels(self) -> bool:
        """The model lives on CPU and pagoda's C++ CPU kernels are built (and not turned off)."""
        first = next(itertools.chain(self.parameters(), self.buffers()), None)
        if first is None or first.device.type != "cpu":
            return False
        from pagoda.kernels.cpu import kernels

        return kernels() is not None

    def _float_linears(self) -> bool:
        """Every decoder projection keeps a plain float weight (no quantization method)."""
        return all(
            m.quant_method is None for m in self.model.layers.modules() if isinstance(m, Linear)
        )


def _copy_param(param: nn.Parameter, tensor: torch.Tensor, name: str) -> None:
    if param.shape != tensor.shape:
        raise ValueError(
            f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
            f"the model expects {tuple(param.shape)}"
        )
    with torch.no_grad():
        param.copy_(tensor)
