"""Which LoRA adapter each device slot holds: the engine's side of multi-LoRA (the workers hold the slots' tensors,
models/lora.py).

An adapter takes a slot when the scheduler admits its first request: a free slot, else the slot of the least
recently used adapter that no running request uses. When every slot holds an adapter that running requests use,
the request waits. The loads this decides go to the workers with the next step, which loads them before its
forward.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from raylm.engine.request import Request
from raylm.lora_request import LoRARequest


class LoraSlots:
    def __init__(self, max_loras: int):
        self.max_loras = max_loras
        self.resident: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> slot, least recently used first
        self.pending_loads: list[tuple[int, LoRARequest]] = []

    def acquire(self, lora: LoRARequest, running: Iterable[Request]) -> int | None:
        """The slot holding `lora` for a request about to run: where it is resident, else one freed for it (its load
        queued); None when every slot holds an adapter of a running request."""
        slot = self.resident.get(lora.lora_int_id)
        if slot is not None:
            self.resident.move_to_end(lora.lora_int_id)
            return slot
        if len(self.resident) < self.max_loras:
            slot = min(set(range(self.max_loras)) - set(self.resident.values()))
        else:
            in_use = {request.lora_request.lora_int_id for request in running if request.lora_request is not None}
            victim = next((lora_id for lora_id in self.resident if lora_id not in in_use), None)
            if victim is None:
                return None
            slot = self.resident.pop(victim)
            self.pending_loads = [(pending, request) for pending, request in self.pending_loads if pending != slot]
        self.resident[lora.lora_int_id] = slot
        self.pending_loads.append((slot, lora))
        return slot

    def take_pending_loads(self) -> list[tuple[int, LoRARequest]]:
        """The loads for the next step to do before its forward (each once)."""
        loads, self.pending_loads = self.pending_loads, []
        return loads

    def evict(self, lora_int_id: int) -> None:
        """The adapter goes (LLM.remove_lora): its slot is free, and a load of it not yet done is dropped."""
        slot = self.resident.pop(lora_int_id, None)
        if slot is not None:
            self.pending_loads = [(pending, request) for pending, request in self.pending_loads if pending != slot]

    def forget(self) -> None:
        """The slots' contents are unknown (a step failed, perhaps while loading): every adapter is loaded again
        when next used."""
        self.resident.clear()
        self.pending_loads = []
