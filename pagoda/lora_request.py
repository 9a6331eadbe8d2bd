"""LoRARequest: which adapter a request runs with (vLLM's `vllm.lora.request.LoRARequest`).

Plain data: it crosses the process boundary inside `EngineRequest` as it is. `lora_int_id`
names the adapter inside the engine (>= 1; 0 is the base model), `lora_name` is what the
server's `model` field and `/v1/models` show, `lora_path` a PEFT folder
(`adapter_config.json` + `adapter_model.safetensors`) or a llama.cpp GGUF LoRA file.
"""

from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("lora_name must be a non-empty string")
        if (
            not isinstance(self.lora_int_id, int)
            or isinstance(self.lora_int_id, bool)
            or self.lora_int_id < 1
        ):
            raise ValueError(f"lora_int_id must be an int >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str):
            raise ValueError("lora_path must be a string")

    @property
    def cache_key(self) -> str:
        """What the prefix cache's hash chain adds for this adapter: two adapters (or one name
        reloaded from another path) never share KV blocks."""
        return f"lora:{self.lora_int_id}:{self.lora_name}:{self.lora_path}"
