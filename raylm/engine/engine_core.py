"""The engine core: one iteration = schedule, run the model, sample, update requests, report.

With overlapped scheduling (a runner that can launch steps without waiting for them), iteration N+1 is
scheduled and queued on the device before iteration N's draws are applied: each sequence drawing in N holds
a placeholder token that N+1 reads from the device, so the host's work for N+1 and for N's results runs
while the device computes. A sequence that stops at N has computed one token too many in N+1, which is
dropped. Requests whose next step needs their drawn tokens on the host (penalties, forking into several
sequences, beam search) make the step after theirs wait for their results first.

For RL loops generation can be paused (running requests aborted, or parked and continued after resume) while
the workers' weights change; each new set of weights is a new weight version, which outputs report and which
salts the prefix cache, so KV computed with older weights is never reused for requests that come after.

A request with structured output (guided_decoding) waits outside the scheduler while its grammar compiles on the
compiler's thread; then each of its sequences carries a Guide that masks its draws.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass

from raylm.engine.generation_control import GenerationControl
from raylm.engine.kv_cache import KVCacheManager, hash_chain_root
from raylm.engine.lora_slots import LoraSlots
from raylm.engine.messages import EngineRequest, RequestDelta, SequenceDelta, StepOutput
from raylm.engine.progress import Progress
from raylm.engine.request import FinishReason, Request, RequestStatus
from raylm.engine.scheduler import Scheduler, SchedulerOutput
from raylm.engine.speculative import DraftModelProposer, NGramProposer, can_speculate, fit_rows
from raylm.engine.stats import iteration_stats
from raylm.engine.step_runner import ModelOutput, RanksOutOfStep, StepRunner
from raylm.engine.structured_output import GrammarCompiler, Guide
from raylm.lora_request import LoRARequest

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineLimits:
    """Engine-side limits, fixed at start-up."""

    max_batch_size: int
    max_num_tokens: int
    max_seq_len: int
    block_size: int
    num_blocks: int
    enable_block_reuse: bool
    enable_chunked_prefill: bool
    event_buffer_max_size: int
    iter_stats_max_iterations: int
    overlap_scheduling: bool = True
    guarantee_no_evict: bool = False  # scheduler_config.capacity_scheduler_policy == "GUARANTEED_NO_EVICT"
    max_loras: int = 0  # LoRA adapter slots on the device (lora_config.max_loras); 0: no adapters
    # The rows of the largest decode graph that takes verify rows (speculative decoding; None: no graphs): drafts
    # are trimmed to fit it (speculative.fit_rows).
    max_verify_rows: int | None = None


@dataclass
class InFlight:
    """A launched step whose results are not applied yet."""

    launched: object  # what the runner's launch returned
    overlappable: bool  # every sequence drawing in it holds a placeholder
    start: float


class EngineCore(GenerationControl):
    def __init__(self, runner: StepRunner, limits: EngineLimits,
                 grammar_compiler: Callable[[], GrammarCompiler] | None = None,
                 proposer: NGramProposer | DraftModelProposer | None = None):
        """grammar_compiler: makes the compiler for structured output at the first request that needs it (it
        loads the tokenizer); None where the engine has no tokenizer. proposer: speculative decoding's
        (engine/speculative.py), or None."""
        self.runner = runner
        self.limits = limits
        self.kv_cache = KVCacheManager(limits.num_blocks, limits.block_size, limits.enable_block_reuse,
                                       limits.event_buffer_max_size)
        self.scheduler = Scheduler(self.kv_cache, limits.max_batch_size, limits.max_num_tokens,
                                   limits.enable_chunked_prefill, limits.guarantee_no_evict,
                                   LoraSlots(limits.max_loras) if limits.max_loras else None)
        self.progress = Progress(self.scheduler, limits.max_seq_len)
        self.requests: dict[str, Request] = {}
        self.iteration = 0
        self.overlap = limits.overlap_scheduling and runner.can_overlap
        # A pipeline overlaps different sequences in consecutive steps (actors/distributed_runner.py).
        self.scheduler.skip_in_flight = self.overlap and runner.pipelined
        self.in_flight: InFlight | None = None
        self.weight_version = 0
        self.paused = False  # pause_generation: no steps run; requests wait (new ones too) until resume
        self._control_deltas: list[RequestDelta] = []  # deltas of control calls, for the next output
        self._make_grammar_compiler = grammar_compiler
        self._grammar_compiler: GrammarCompiler | None = None
        self._compiling: list[Request] = []  # requests whose grammar is compiling, in arrival order
        self.proposer = proposer
        self._lora_generations: dict[int, int] = {}  # lora_int_id -> how many times remove_lora freed it

    @property
    def has_work(self) -> bool:
        return not self.paused and (self.scheduler.has_work or self.in_flight is not None or bool(self._compiling))

    def add_request(self, engine_request: EngineRequest) -> None:
        if engine_request.request_id in self.requests:
            raise ValueError(f"request id {engine_request.request_id!r} is already in use")
        lora = engine_request.lora_request
        if lora is not None and self.scheduler.lora_slots is None:
            raise ValueError("lora_request needs an engine started with lora_config")
        request = Request(
            request_id=engine_request.request_id,
            prompt_token_ids=list(engine_request.prompt_token_ids),
            sampling_params=engine_request.sampling_params,
            priority=engine_request.priority,
            cache_salt=engine_request.cache_salt,
            hash_root=self._hash_root(lora),
            lora_request=lora,
        )
        request.speculates = self.proposer is not None and can_speculate(request.sampling_params)
        guided = engine_request.sampling_params.guided_decoding
        if guided is not None:
            request.grammar = self.grammar_compiler().compile(guided)
            self.requests[request.request_id] = request
            self._compiling.append(request)
            return
        self.requests[request.request_id] = request
        self.scheduler.add_request(request)

    def grammar_compiler(self) -> GrammarCompiler:
        if self._grammar_compiler is None:
            if self._make_grammar_compiler is None:
                raise ValueError("guided_decoding needs the model's tokenizer, and this engine has none "
                                 "(skip_tokenizer_init)")
            self._grammar_compiler = self._make_grammar_compiler()
        return self._grammar_compiler

    def _admit_compiled(self) -> list[RequestDelta]:
        """Requests whose grammar has compiled join the scheduler, each sequence with its Guide; those whose grammar
        failed to compile end with its error. With nothing else to run, waits a little for a compilation."""
        if not self.scheduler.has_work and self.in_flight is None:
            wait([request.grammar for request in self._compiling], timeout=0.005, return_when=FIRST_COMPLETED)
        deltas, waiting = [], []
        for request in self._compiling:
            future = request.grammar
            if not future.done():
                waiting.append(request)
                continue
            error = future.exception()
            if error is not None:
                self.requests.pop(request.request_id, None)
                request.status = RequestStatus.FINISHED
                deltas.append(RequestDelta(request.request_id, finished=True, error=str(error)))
                continue
            compiler = self.grammar_compiler()
            guided = request.sampling_params.guided_decoding
            stop_ids = sorted(request.stop_ids) or list(compiler.info.stop_token_ids)
            begin_after = compiler.token_ids(guided.begin_after) if guided.begin_after else None
            request.sequences[0].guide = Guide(future.result(), stop_ids, begin_after)
            self.scheduler.add_request(request)
        self._compiling = waiting
        return deltas

    def abort_request(self, request_id: str, error: str | None = None,
                      reason: str | None = None) -> RequestDelta | None:
        """Stops a request and frees its blocks; returns its final delta (None if it is unknown). `reason` becomes
        the stop_reason of the sequences it cut short (finish_reason "abort")."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request in self._compiling:
            self._compiling.remove(request)
        delta = RequestDelta(request_id, finished=True, error=error)
        for seq in request.sequences:
            if seq.finish_reason is None and reason is not None:
                delta.sequences.append(SequenceDelta(seq.index, [], cumulative_logprob=seq.cumulative_logprob,
                                                     finish_reason=FinishReason.ABORT.value, stop_reason=reason))
            seq.finish_reason = seq.finish_reason or FinishReason.ABORT
        self.scheduler.finish_request(request)
        return delta

    # ------------------------------------------------------------------ RL control (between steps, drained)

    def pause(self, abort: bool) -> int:
        """Stops running steps until resume_generation. With `abort`, every request ends now (finish_reason
        "abort", stop_reason "generation paused", its blocks freed); otherwise running requests are parked and go
        on after resume. Requests that arrive meanwhile wait. Returns how many requests were aborted."""
        if self.in_flight is not None:
            raise RuntimeError("pause needs the step in flight applied first (drain)")
        return super().pause(abort)

    def request_ids(self) -> list[str]:
        return list(self.requests)

    def new_weight_version(self) -> int:
        """The workers hold new weights: outputs from now on report the next version, and requests admitted from
        now on (or still waiting with nothing computed) start their prefix-cache chains from its root, so they
        never reuse KV computed with earlier weights but share prefixes among themselves."""
        self.weight_version += 1
        for request in self.scheduler.waiting:
            if all(seq.num_computed_tokens == 0 for seq in request.sequences):
                request.hash_root = self._hash_root(request.lora_request)
                request.prompt_block_hashes = []
        return self.weight_version

    def _hash_root(self, lora: LoRARequest | None) -> int | None:
        if lora is None:
            return hash_chain_root(self.weight_version)
        return hash_chain_root(self.weight_version, lora.lora_int_id, self._lora_generations.get(lora.lora_int_id, 0))

    def remove_lora(self, lora_int_id: int) -> None:
        """The adapter under lora_int_id goes (LLM.remove_lora): its device slot is freed, and KV computed with it
        is never matched again (the id may come back as another adapter). Refused while requests use it."""
        users = [request.request_id for request in self.requests.values()
                 if request.lora_request is not None and request.lora_request.lora_int_id == lora_int_id]
        if users:
            raise ValueError(f"LoRA adapter {lora_int_id} is in use by {len(users)} unfinished request(s) "
                             f"({', '.join(users[:3])}): wait for them or abort them before removing it")
        if self.scheduler.lora_slots is not None:
            self.scheduler.lora_slots.evict(lora_int_id)
        self._lora_generations[lora_int_id] = self._lora_generations.get(lora_int_id, 0) + 1

    def forget_kv(self) -> int:
        """The KV cache's contents are going away (release of kv_cache): parked requests are preempted, to be
        computed again after resume, and no cached prefix can be matched. Returns how many were preempted."""
        if self.in_flight is not None:
            raise RuntimeError("forget_kv needs the step in flight applied first (drain)")
        parked = list(self.scheduler.running)
        for request in parked:
            self.scheduler.preempt(request)
        self.kv_cache.forget_cached_prefixes()
        return len(parked)

    def stop_sequence(self, request_id: str, index: int) -> RequestDelta | None:
        """Ends one sequence of a request (the driver saw a stop string); the request ends with its last."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        for seq in request.sequences:
            if seq.index == index and not seq.finished:
                seq.finish_reason = FinishReason.STOP
                self.kv_cache.free(seq)
        if request.live_sequences:
            return None
        self.requests.pop(request_id)
        self.scheduler.finish_request(request)
        return RequestDelta(request_id, finished=True)

    def step(self) -> StepOutput:
        start = time.perf_counter()
        previous, self.in_flight = self.in_flight, None
        deltas: list[RequestDelta] = self._admit_compiled() if self._compiling else []
        stats = None
        if previous is not None and not previous.overlappable:
            deltas, stats = self._finish(previous)
            previous = None
        drafts = None
        if self.proposer is not None:
            drafts = fit_rows(self.proposer.drafts_for(self.scheduler.running, self.limits.max_seq_len),
                              len(self.scheduler.running), self.limits.max_verify_rows)
            self.progress.speculating = drafts is not None
        out = self.scheduler.schedule(drafts)
        if drafts:
            self.proposer.fill(out)
        if not out.is_empty:
            try:
                if self.overlap:
                    launched = self.runner.launch(out, previous.launched if previous is not None else None)
                    self.in_flight = InFlight(launched, self.progress.launched(out, placeholders=True), start)
                else:
                    model_output = self.runner.execute(out)
                    self.progress.launched(out, placeholders=False)
            except Exception as exc:  # a failed step fails its requests (_fail says when it stops the engine)
                deltas.extend(self._fail(out, exc))
            else:
                if not self.overlap:
                    deltas.extend(self._apply(out, model_output, start))
                    stats = self._stats(out, deltas, start)
        if previous is not None:
            finished, stats = self._finish(previous)
            deltas.extend(finished)
        if not deltas and stats is None and out.is_empty:
            return StepOutput(weight_version=self.weight_version)
        return StepOutput(deltas, stats, self.kv_cache.take_events(), weight_version=self.weight_version)

    def drain(self) -> StepOutput | None:
        """Applies the step in flight, if any (before weights or the cache change under it)."""
        if self.in_flight is None:
            return None
        previous, self.in_flight = self.in_flight, None
        deltas, stats = self._finish(previous)
        return StepOutput(deltas, stats, self.kv_cache.take_events(), weight_version=self.weight_version)

    def _finish(self, in_flight: InFlight) -> tuple[list[RequestDelta], dict | None]:
        out = in_flight.launched.out
        try:
            model_output = self.runner.collect(in_flight.launched)
        except Exception as exc:
            deltas = self._fail(out, exc)
        else:
            deltas = self._apply(out, model_output, in_flight.start)
        return deltas, self._stats(out, deltas, in_flight.start)

    def _apply(self, out: SchedulerOutput, model_output: ModelOutput, start: float) -> list[RequestDelta]:
        try:
            deltas = self.progress.apply(out, model_output.samples, model_output.prompt_logprobs)
        except Exception as exc:
            return self._fail(out, exc)
        for delta in deltas:
            if delta.finished:
                self.requests.pop(delta.request_id, None)
        return deltas

    def _fail(self, out: SchedulerOutput, exc: Exception) -> list[RequestDelta]:
        if isinstance(exc, RanksOutOfStep):  # the ranks cannot go on together: the engine stops
            raise exc
        logger.exception("engine step failed")
        if self.scheduler.lora_slots is not None:  # it may have failed while loading adapters into slots
            self.scheduler.lora_slots.forget()
        failed = {item.request.request_id for item in out.scheduled}
        message = f"engine step failed: {type(exc).__name__}: {exc}"
        return [delta for rid in failed if (delta := self.abort_request(rid, message)) is not None]

    def _stats(self, out: SchedulerOutput, deltas: list[RequestDelta], start: float) -> dict | None:
        self.iteration += 1
        if not self.limits.iter_stats_max_iterations:
            return None
        num_completed = sum(1 for delta in deltas if delta.finished)
        stats = iteration_stats(self.iteration, time.perf_counter() - start, self.scheduler, self.kv_cache,
                                out, num_completed, self.runner.device)
        if self.proposer is not None:
            requests, drafts, accepted = self.progress.step_drafts
            stats["specDecodingStats"] = {
                "numRequestsWithDraftTokens": requests,
                "numDraftTokens": drafts,
                "numAcceptedTokens": accepted,
                "acceptanceLength": (requests + accepted) / requests if requests else 0.0,
                "totalDraftTokens": self.progress.num_draft_tokens,
                "totalAcceptedTokens": self.progress.num_accepted_drafts,
            }
        return stats
