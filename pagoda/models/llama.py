"""Llama-family decoder: Llama 2/3, Mistral, SmolLM2, Qwen2 (q/k/v bias).

Parameter names follow HF (model.layers.N.self_attn.q_proj, ...); internally q/k/v and gate/up
are packed into `qkv_proj` and `gate_up_proj`, and `load_weights` routes each HF tensor to its
slice. The forward pass takes the flat batch (all scheduled tokens of all requests,
concatenated) and must run inside `forward_context(...)`, which supplies the paged KV caches.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any, cast

import torch
from torch import nn

from pagoda.layers.activation import SiluAndMul
from pagoda.layers.attention import Attention
from pagoda.layers.embedding import LMHead, VocabEmbedding
from pagoda.layers.forward_context import ForwardContext
from pagoda.layers.gguf import GGUFWeight
from pagoda.layers.linear import Linear, MergedLinear
from pagoda.layers.norm import RMSNorm
from pagoda.layers.parallel import SINGLE, WHOLE_MODEL, PipelineStage, TensorParallel
from pagoda.layers.rotary import apply_rotary, get_rope
from pagoda.model_config import head_dim_of

# (packed param prefix, HF projection name, shard id)
PACKED_MODULES = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", "gate"),
    ("gate_up_proj", "up_proj", "up"),
)


class LlamaMLP(nn.Module):
    """gate_up_proj, SiLU-and-mul, down_proj: run by LlamaDecoderLayer.forward, which feeds
    gate_up_proj its norm (Linear.after_norm) and down_proj its activation (after_act)."""

    def __init__(self, config: Any, dtype: torch.dtype, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        hidden = config.hidden_size
        bias = bool(getattr(config, "mlp_bias", False))
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported; only silu")
        # tensor parallel: gate/up split by rows (column-parallel), down_proj by columns
        part = tp.part(config.intermediate_size, "intermediate_size")
        inter = part[1]
        self.gate_up_proj = MergedLinear(
            hidden, {"gate": inter, "up": inter}, bias, dtype, tp, {"gate": part, "up": part}
        )
        self.down_proj = Linear(inter, hidden, bias, dtype, tp, part)
        self.act_fn = SiluAndMul()


class LlamaAttention(nn.Module):
    """qkv_proj, then `attend` (rotary, the KV-cache write, paged attention), then o_proj: run by
    LlamaDecoderLayer.forward, which feeds qkv_proj its norm (Linear.after_norm)."""

    qkv_bias = False  # bias on q/k/v even without `attention_bias` (Qwen2)
    backend = "torch"  # "triton": rotary fused into the KV-cache write; set by the model runner
    cpu_kernel = False  # float32 rotary on pagoda's C++ kernels (kernels/cpu/row_ops.cpp)

    def __init__(
        self, config: Any, layer_idx: int, dtype: torch.dtype, tp: TensorParallel = SINGLE
    ) -> None:
        super().__init__()
        # This rank's heads (all of them without tensor parallelism): layers/parallel.py
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        (first_head, self.num_heads), (first_kv_head, self.num_kv_heads) = tp.heads(
            total_heads, total_kv_heads
        )
        self.head_dim = head_dim_of(config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        attention_bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = attention_bias or self.qkv_bias
        d = self.head_dim
        q_part = (first_head * d, self.q_size)
        kv_part = (first_kv_head * d, self.kv_size)
        self.qkv_proj = MergedLinear(
            config.hidden_size,
            {"q": self.q_size, "k": self.kv_size, "v": self.kv_size},
            qkv_bias,
            dtype,
            tp,
            {"q": q_part, "k": kv_part, "v": kv_part},
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, attention_bias, dtype, tp, q_part)
        scale = self.head_dim**-0.5
        # q and k are still adjacent in qkv at rotary time unless a subclass transforms them
        self.joint_rotary = type(self).qk_transform is LlamaAttention.qk_transform
        self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads, scale, layer_idx)

    def attend(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        ctx: ForwardContext | None = None,
    ) -> torch.Tensor:
        """Attention from the packed projection, before o_proj: rotary, the KV-cache write and
        paged attention. qkv: (num_tokens, (num_heads + 2 * num_kv_heads) * head_dim) ->
        (num_tokens, num_heads * head_dim)."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.backend == "triton":
            # One launch: q/k per-head norm (if any), q rotated in place, k rotated into the
            # cache, v written.
            norm = self.qk_norm_weights()
            if norm is None:
                q, k = self.qk_transform(q, k)
            return self.attn(q, k, v, ctx, rotary=(cos, sin), qk_norm=norm)
        q, k = self.qk_transform(q, k)
        rotate = (
            self._rotate_cpu if self.cpu_kernel and qkv.dtype == torch.float32 else apply_rotary
        )
        if self.joint_rotary:
            # q and k are adjacent in qkv: one rotation over both heads' rows
            qk = rotate(qkv[:, : self.q_size + self.kv_size], cos, sin, self.head_dim)
            q, k = qk.split([self.q_size, self.kv_size], dim=-1)
        else:
            q = rotate(q, cos, sin, self.head_dim)  # (num_tokens, num_heads * head_dim)
            k = rotate(k, cos, sin, self.head_dim)  # (num_tokens, num_kv_heads * head_dim)
        return self.attn(q, k, v, ctx)  # (num_tokens, num_heads * head_dim)

    @staticmethod
    def _rotate_cpu(
        x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int
    ) -> torch.Tensor:
        """apply_rotary on pagoda's CPU kernels; cos, sin: (num_tokens, 1, head_dim // 2)."""
        return torch.ops.pagoda_cpu.rotary(x, cos.squeeze(1), sin.squeeze(1), head_dim, 2)

    def qk_transform(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Hook applied to q and k before rotary (Qwen3 normalizes per head here)."""
        return q, k

    def qk_norm_weights(self) -> tuple[torch.Tensor, torch.Tensor, float] | None:
        """(q weight, k weight, eps) when qk_transform is exactly a per-head RMSNorm of q and of
        k: the triton backend then fuses it into its rotary launch instead of calling it."""
        return None


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: Any,
        layer_idx: int,
        dtype: torch.dtype,
        attention_cls: type[LlamaAttention],
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.self_attn = attention_cls(config, layer_idx, dtype, tp)
        self.mlp = LlamaMLP(config, dtype, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(
        self,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        ctx: ForwardContext | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # hidden_states, residual: (num_tokens, hidden_size); residual is None for layer 0.
        # Each norm runs with the projection after it (Linear.after_norm: one op on the CPU
        # kernels), SiLU-and-mul with down_proj.
        attn, mlp = self.self_attn, self.mlp
        qkv, residual = attn.qkv_proj.after_norm(hidden_states, residual, self.input_layernorm)
        hidden_states = attn.o_proj(attn.attend(qkv, cos, sin, ctx))  # (num_tokens, hidden_size)
        gate_up, residual = mlp.gate_up_proj.after_norm(
            hidden_states, residual, self.post_attention_layernorm
        )
        return mlp.down_proj.after_act(gate_up, mlp.act_fn), residual

    def forward_fused(
        self,
        stream: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        ctx: ForwardContext | None = None,
    ) -> torch.Tensor:
        """The same layer in 7 launches for at most fused_linear.MAX_ROWS tokens (triton backend,
        unquantized linears): the norms, the residual adds and SiLU-and-mul run inside the
        projections (kernels/fused_linear.py). stream: (num_tokens, hidden_size), the residual
        stream (`hidden_states + residual` of `forward`) -> the next layer's stream."""
        from pagoda.kernels.fused_linear import fused_linear

        attn, mlp = self.self_attn, self.mlp
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        qkv_proj, o_proj = attn.qkv_proj, attn.o_proj
        qkv = fused_linear(stream, qkv_proj.weight, qkv_proj.bias, norm=(norm1.weight, norm1.eps))
        out = attn.attend(qkv, cos, sin, ctx)  # (num_tokens, num_heads * head_dim)
        stream = fused_linear(out, o_proj.weight, o_proj.bias, residual=stream)
        gate_up, down = mlp.gate_up_proj, mlp.down_proj
        norm = (norm2.weight, norm2.eps)
        act = fused_linear(stream, gate_up.weight, gate_up.bias, norm=norm, silu_mul=True)
        return fused_linear(act, down.weight, down.bias, residual=stream)


class MissingLayer(nn.Module):
    """A decoder layer another pipeline stage holds: keeps the layer list's indices (and so the
    checkpoint's names) aligned with the model's."""


class LlamaModel(nn.Module):
    # Steps of at most this many tokens run the layers' fused forms (forward_fused); 0: never.
    # Set by LlamaForCausalLM.set_kernel_backend.
    fused_max_rows = 0

    def __init__(
        self,
        config: Any,
        dtype: torch.dtype,
        attention_cls: type[LlamaAttention],
        tp: TensorParallel = SINGLE,
        pp: PipelineStage = WHOLE_MODEL,
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
            LlamaDecoderLayer(config, i - self.start_layer, dtype, attention_cls, tp)
            if self.start_layer <= i < self.end_layer
            else MissingLayer()
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype) if pp.is_last else None
        self.rotary_emb = get_rope(
            config, head_dim_of(config), config.max_position_embeddings, dtype
        )

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
            hidden_states = self.embed_tokens(input_ids)  # (num_tokens, hidden_size)
        else:
            if stream is None:
                shape = (2, input_ids.shape[0], self.hidden_size)
                stream = torch.zeros(shape, dtype=self.dtype, device=input_ids.device)
            hidden_states, residual = stream[0], stream[1]
        cos, sin = self.rotary_emb.cos_sin(positions, hidden_states.dtype)
        if hidden_states.shape[0] <= self.fused_max_rows:  # a shape: no host sync
            for layer in self.layers:
                fused = cast(LlamaDecoderLayer, layer).forward_fused
                hidden_states = fused(hidden_states, cos, sin, ctx)
            assert self.norm is not None  # the fused forms run on the whole model only
            return self.norm(hidden_states)
        for layer in self.layers[self.start_layer : self.end_layer]:
            hidden_states, residual = layer(hidden_states, residual, cos, sin, ctx)
        assert residual is not None  # every stage holds at least one layer
        if self.norm is None:
            return torch.stack((hidden_states, residual))
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states  # (num_tokens, hidden_size)


class LlamaForCausalLM(nn.Module):
    attention_cls: type[LlamaAttention] = LlamaAttention

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
        self.model = LlamaModel(hf_config, dtype, self.attention_cls, tp, pp)
        self.lm_head = (
            LMHead(hf_config.vocab_size, hf_config.hidden_size, dtype, tp) if pp.is_last else None
        )
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        # A tied head on a later stage than the embedding loads the embedding's matrix itself.
        embedding = self.model.embed_tokens
        if self.tie_word_embeddings and self.lm_head is not None and embedding is not None:
            self.lm_head.tie_to(embedding)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, stream: torch.Tensor | None = None
    ) -> torch.Tensor:
        # input_ids, positions: (num_tokens,) -> hidden states (num_tokens, hidden_size); under
        # pipeline parallelism see LlamaModel.forward for `stream` and a non-last stage's result
        return self.model(input_ids, positions, stream=stream)

    def compute_logits(self, hidden_states: torch.Tensor, float32: bool = True) -> torch.Tensor:
        # hidden_states: (n, hidden_size) -> (n, vocab_size) float32 (else the model's dtype)
        if self.lm_head is None:
            raise RuntimeError("only the last pipeline stage holds the LM head")
        return self.lm_head(hidden_states, float32)

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
            for packed, hf_proj, shard in PACKED_MODULES:
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

    def set_kernel_backend(self, backend: str) -> None:
        """Route attention, norms, activation and rotary to "torch" (the reference) or "triton"
        (pagoda/kernels, needs CUDA or TRITON_INTERPRET=1)."""
        cpu_kernel = backend == "torch" and self._cpu_kernels()
        for module in self.modules():
            if isinstance(module, (Attention, RMSNorm, SiluAndMul, LlamaAttention)):
                module.backend = backend
            if isinstance(module, (Attention, RMSNorm, SiluAndMul, LlamaAttention)):
                module.cpu_kernel = cpu_kernel
        self.model.fused_max_rows = 0
        # the fused forms add the residual inside row-parallel projections and keep no separate
        # residual to pass between stages: one rank only
        whole = self.tp.size == 1 and self.pp.size == 1
        if backend == "triton" and self._float_linears() and whole:
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

    def finalize_weights(self) -> None:
        """After loading: every quantized layer builds its stored form."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.finalize()


def _copy_param(param: nn.Parameter, tensor: torch.Tensor, name: str) -> None:
    if param.shape != tensor.shape:
        raise ValueError(
            f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
            f"the model expects {tuple(param.shape)}"
        )
    with torch.no_grad():
        param.copy_(tensor)


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2Attention(LlamaAttention):
    qkv_bias = True


class Qwen2ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen2Attention
