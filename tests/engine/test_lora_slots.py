"""LoRA adapter slots (engine/lora_slots.py) and the scheduler's use of them: an adapter takes a free slot or the
least recently used one that no running request uses; a request waits while none is free; loads go out with the
next step that runs, and rows carry their slot into the step's plan."""

from __future__ import annotations

from raylm.engine.kv_cache import KVCacheManager
from raylm.engine.lora_slots import LoraSlots
from raylm.engine.request import Request
from raylm.engine.scheduler import Scheduler
from raylm.engine.step_plan import plan_step
from raylm.lora_request import LoRARequest
from raylm.sampling_params import SamplingParams
from tests.engine.test_scheduler import run_step

ADAPTERS = {lora_id: LoRARequest(f"a{lora_id}", lora_id, f"/adapters/{lora_id}") for lora_id in (1, 2, 3)}


def _request(request_id: str, lora_id: int | None, length: int = 6, max_tokens: int = 2) -> Request:
    return Request(request_id, list(range(length)), SamplingParams(max_tokens=max_tokens),
                   lora_request=ADAPTERS.get(lora_id))


def test_adapters_take_free_slots_then_the_least_recently_used_idle_one():
    slots = LoraSlots(2)
    assert slots.acquire(ADAPTERS[1], []) == 0
    assert slots.acquire(ADAPTERS[2], []) == 1
    assert slots.acquire(ADAPTERS[1], []) == 0  # resident: no load, and now the most recently used
    assert slots.take_pending_loads() == [(0, ADAPTERS[1]), (1, ADAPTERS[2])]
    assert slots.acquire(ADAPTERS[3], []) == 1  # adapter 2 was used least recently
    assert slots.take_pending_loads() == [(1, ADAPTERS[3])]
    assert list(slots.resident) == [1, 3]


def test_adapters_of_running_requests_keep_their_slots():
    slots = LoraSlots(2)
    slots.acquire(ADAPTERS[1], [])
    slots.acquire(ADAPTERS[2], [])
    assert slots.acquire(ADAPTERS[3], [_request("a", 1), _request("b", 2)]) is None
    assert slots.acquire(ADAPTERS[3], [_request("b", 2)]) == 0
    slots.forget()
    assert not slots.resident and not slots.take_pending_loads()


def test_a_request_waits_for_a_slot_while_running_requests_hold_every_one():
    scheduler = Scheduler(KVCacheManager(64, 4, True), 8, 64, lora_slots=LoraSlots(1))
    for request in (_request("first", 1), _request("base", None), _request("second", 2), _request("third", 1)):
        scheduler.add_request(request)
    out = run_step(scheduler)
    assert [item.request.request_id for item in out.scheduled] == ["first", "base"]
    assert out.lora_loads == [(0, ADAPTERS[1])]
    plan = plan_step(out, 4)
    assert plan.lora_slots == [0] * 6 + [-1] * 6 and plan.lora_loads == [(0, ADAPTERS[1])]
    out = run_step(scheduler)  # "first" decodes its last token and finishes; "second" still waits
    assert [item.request.request_id for item in out.scheduled] == ["first", "base"] and not out.lora_loads
    out = run_step(scheduler)
    assert [item.request.request_id for item in out.scheduled] == ["second"]
    assert out.lora_loads == [(0, ADAPTERS[2])]
    assert scheduler.waiting[0].request_id == "third"  # adapter 1 waits for adapter 2's request to end


def test_a_step_without_adapters_plans_no_lora_rows():
    scheduler = Scheduler(KVCacheManager(64, 4, True), 8, 64, lora_slots=LoraSlots(1))
    scheduler.add_request(_request("base", None))
    plan = plan_step(scheduler.schedule(), 4)
    assert plan.lora_slots == [] and plan.lora_loads == []
