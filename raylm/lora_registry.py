"""The driver's side of multi-LoRA: which adapter each lora_int_id names, checked before any request runs with it.

An id names one adapter until remove_lora frees it: one a request brought by its path (the workers read it when
its slot needs it, keeping an LRU of copies), or one add_lora loaded onto every worker (a path, or an RL trainer's
adapter in memory), which the workers keep until it is removed. Requests reach the engine carrying the adapter by
name, id and path only, never its tensors.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import weakref
from typing import Any

from raylm.config import LoraConfig
from raylm.lora_request import LoRARequest
from raylm.models.arch import ArchConfig
from raylm.models.registry import resolve_architecture


def check_lora_model(config: LoraConfig, hf_config: Any, encode_only: bool) -> ArchConfig:
    """The model's architecture, which adapters are checked against, after checking that the model takes
    adapters and that every adapter of config.lora_dir fits it."""
    from raylm.models.llama import LlamaForCausalLM
    from raylm.models.lora_adapter import check_adapter

    entry, arch = resolve_architecture(hf_config)
    if encode_only or entry.model_class is not LlamaForCausalLM:
        raise ValueError(f"lora_config needs a generating model of the Llama family, got "
                         f"{entry.model_class.__name__}{' (encode_only)' if encode_only else ''}")
    for path in config.lora_dir:
        check_adapter(path, arch, config.max_lora_rank)
    return arch


def require_lora_request(value: Any) -> LoRARequest:
    if not isinstance(value, LoRARequest):
        raise TypeError(f"lora_request must be a LoRARequest, got {type(value).__name__}")
    return value


class LoraRegistry:
    """The adapters of one engine by id; `executor` reaches its workers (Worker.add_lora / remove_lora) and its
    engine (EngineCore.remove_lora). Safe to call from any thread."""

    def __init__(self, config: LoraConfig, arch: ArchConfig, executor: Any):
        self.config = config
        self.arch = arch
        self.executor = executor
        self._adapters: dict[int, LoRARequest] = {}  # lora_int_id -> the adapter under it, as requests carry it
        # The ids add_lora loaded onto the workers -> the in-memory LoRARequest that added it (None: a path).
        self._added: dict[int, weakref.ref | None] = {}
        self._lock = threading.Lock()

    def resolve(self, lora_request: LoRARequest) -> LoRARequest:
        """The adapter a request runs with, as it goes to the engine: its files checked (once per id), under an id
        no other adapter holds; one in memory is added first and travels by name and id."""
        with self._lock:
            known = self._adapters.get(lora_request.lora_int_id)
            if known is not None:
                self._check_same_adapter(known, lora_request)
                return known
            if lora_request.in_memory:
                return self._add(lora_request)
            if not lora_request.lora_path:
                raise ValueError(f"no LoRA adapter was added under lora_int_id {lora_request.lora_int_id}: "
                                 "give its lora_path, or the adapter in memory (peft_config, lora_tensors)")
            self._check(lora_request)
            self._adapters[lora_request.lora_int_id] = lora_request
            return lora_request

    def add(self, lora_request: LoRARequest) -> bool:
        """LLM.add_lora: False when the id already holds this adapter on the workers."""
        with self._lock:
            known = self._adapters.get(lora_request.lora_int_id)
            if known is not None:
                self._check_same_adapter(known, lora_request)
                if known.lora_int_id in self._added:
                    return False
            elif not (lora_request.lora_path or lora_request.in_memory):
                raise ValueError(f"add_lora needs the adapter's lora_path, or the adapter in memory (peft_config, "
                                 f"lora_tensors); lora_int_id {lora_request.lora_int_id} holds none")
            self._add(known or lora_request)
            return True

    def remove(self, lora_int_id: int) -> bool:
        """LLM.remove_lora: False when no adapter holds the id."""
        with self._lock:
            if lora_int_id not in self._adapters:
                return False
            self.executor.engine_call("remove_lora", (lora_int_id,))  # refused while requests use it
            self.executor.collective_rpc("remove_lora", (lora_int_id,), None, None)
            del self._adapters[lora_int_id]
            self._added.pop(lora_int_id, None)
            return True

    def adapters(self) -> list[LoRARequest]:
        with self._lock:
            return [self._adapters[lora_id] for lora_id in sorted(self._adapters)]

    def _check_same_adapter(self, known: LoRARequest, lora_request: LoRARequest) -> None:
        """A request naming an id that holds an adapter must mean that adapter: by id alone, by its path, or (in
        memory) as the very LoRARequest that added it."""
        if not (lora_request.lora_path or lora_request.in_memory):
            return
        if known.lora_path and lora_request.lora_path == known.lora_path:
            return
        added_by = self._added.get(known.lora_int_id)
        if lora_request.in_memory and added_by is not None and added_by() is lora_request:
            return
        raise ValueError(f"lora_int_id {known.lora_int_id} already holds the adapter {known.source!r}, got "
                         f"{lora_request.source!r}: use another lora_int_id, or remove_lora({known.lora_int_id}) "
                         "first to replace it")

    def _check(self, lora_request: LoRARequest) -> None:
        """A ValueError naming what does not fit, unless the adapter fits the model."""
        from raylm.models.lora_adapter import check_adapter, check_adapter_in_memory

        if lora_request.in_memory:
            check_adapter_in_memory(lora_request.lora_name, lora_request.peft_config, lora_request.lora_tensors,
                                    self.arch, self.config.max_lora_rank)
        else:
            check_adapter(lora_request.lora_path, self.arch, self.config.max_lora_rank)

    def _add(self, lora_request: LoRARequest) -> LoRARequest:
        """Checks the adapter here, then has every worker keep its matrices; returns what requests carry."""
        self._check(lora_request)
        self.executor.collective_rpc("add_lora", (_shippable(lora_request),), None, None)
        carried = lora_request.reference()
        self._adapters[lora_request.lora_int_id] = carried
        self._added[lora_request.lora_int_id] = weakref.ref(lora_request) if lora_request.in_memory else None
        return carried


def _shippable(lora_request: LoRARequest) -> LoRARequest:
    """An in-memory adapter as the workers take it whatever their process: its config as plain JSON values (PEFT's
    own to_dict() holds a set and PEFT's enum, which a worker without PEFT could not unpickle) and its tensors on
    the CPU (a trainer's may sit on its GPU)."""
    if not lora_request.in_memory:
        return lora_request
    config = json.loads(json.dumps(dict(lora_request.peft_config),
                                   default=lambda value: sorted(value) if isinstance(value, (set, frozenset))
                                   else str(value)))
    tensors = {name: tensor.detach().cpu() for name, tensor in lora_request.lora_tensors.items()}
    return dataclasses.replace(lora_request, peft_config=config, lora_tensors=tensors)
