"""LoRARequest: which LoRA adapter a request generates with (the LLM API's name for it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT-format adapter directory under a name and an integer id. The id identifies the adapter inside the
    engine (its device slot, its prefix-cache blocks): one LLM accepts one path per id."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not self.lora_path:
            raise ValueError("lora_path must name the adapter's directory, got an empty path")
        if not isinstance(self.lora_name, str):
            raise ValueError(f"lora_name must be a string, got {type(self.lora_name).__name__}")
