"""LoRARequest: which LoRA adapter a request generates with (the LLM API's name for it)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter under a name and an integer id, given as one of:
    - lora_path: a PEFT-format directory (adapter_config.json, adapter_model.safetensors);
    - peft_config and lora_tensors: the adapter in memory (PEFT's adapter_config as a dict and its state dict under
      PEFT's names), as an RL trainer hands over the adapter it just trained without writing it to disk;
    - neither: the adapter already added under this id (LLM.add_lora, or an earlier request).
    The id identifies the adapter inside the engine (its device slot, its prefix-cache blocks): it names one adapter
    until LLM.remove_lora frees it."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    peft_config: Mapping[str, Any] | None = field(default=None, compare=False, repr=False)
    lora_tensors: Mapping[str, Any] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_name, str):
            raise ValueError(f"lora_name must be a string, got {type(self.lora_name).__name__}")
        if not isinstance(self.lora_path, str):
            raise ValueError(f"lora_path must be a string, got {type(self.lora_path).__name__}")
        if (self.peft_config is None) != (self.lora_tensors is None):
            raise ValueError("an adapter in memory needs both peft_config and lora_tensors")
        if self.in_memory:
            if self.lora_path:
                raise ValueError("give lora_path or the adapter in memory (peft_config, lora_tensors), not both")
            if not isinstance(self.peft_config, Mapping) or not isinstance(self.lora_tensors, Mapping):
                raise ValueError("peft_config and lora_tensors must be mappings (the adapter's config as a dict, its "
                                 "state dict)")

    @property
    def in_memory(self) -> bool:
        return self.lora_tensors is not None

    @property
    def source(self) -> str:
        """Where the adapter comes from, for messages and /v1/models: its path, or that it came in memory."""
        return self.lora_path or "<in memory>"

    def reference(self) -> LoRARequest:
        """The adapter by name and id alone: what requests carry to the engine once the workers hold its matrices."""
        return dataclasses.replace(self, peft_config=None, lora_tensors=None) if self.in_memory else self
