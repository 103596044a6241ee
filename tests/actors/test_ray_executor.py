"""The Ray executor on CPU (gloo): TP / PP / EP parity, collective_rpc, failures, clean shutdown."""

from __future__ import annotations

import sys
import time

import pytest

from raylm import LLM, KvCacheConfig, SamplingParams, TokensPrompt
from tests.conftest import cluster_placement_groups, hf_greedy, hf_model

PROMPTS = [[504, 3575, 282, 4649, 314], [19556, 28, 957, 1462, 314, 1133, 2040], [2, 9, 77, 1203, 11, 8, 3, 40] * 3]
NEW_TOKENS = 16
KV = KvCacheConfig(max_tokens=2048, tokens_per_block=16)


class OverlapProbe:
    """A worker extension reading rank 0's engine."""

    def engine_overlaps(self) -> bool:
        return self.engine.overlap

    def kernel_choice(self) -> tuple[str, bool | None]:
        config = self.spec.args.kernel_config
        return config.pdl, config.fused_allreduce_norm


@pytest.fixture(scope="module", autouse=True)
def _ship_this_module_by_value(ray_cluster):
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def _generate(llm: LLM) -> list[list[int]]:
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], SamplingParams(max_tokens=NEW_TOKENS),
                           use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def _hf_tokens(path) -> list[list[int]]:
    model = hf_model(path)
    return [hf_greedy(model, prompt, NEW_TOKENS) for prompt in PROMPTS]


@pytest.mark.parametrize(
    ("arch", "tp", "pp", "ep"),
    [
        ("llama", 2, 1, None),
        ("llama", 1, 2, None),
        ("llama", 2, 2, None),
        # 2 KV heads over 4 ranks: each KV head replicated twice (slow: 4 ranks on the CI machine's 2 cores)
        pytest.param("llama", 4, 1, None, marks=pytest.mark.slow),
        ("qwen2", 2, 1, None),
        ("llama_6heads", 3, 1, None),  # a tensor-parallel size that is not a power of two
        ("qwen3_moe", 2, 1, 2),  # experts split over 2 ranks
        ("qwen3_moe", 2, 1, 1),  # every expert's intermediate split over 2 ranks
        ("qwen3_moe", 1, 2, None),
    ],
)
def test_parallel_greedy_tokens_equal_hf(ray_cluster, tiny_model_dirs, arch, tp, pp, ep):
    path = tiny_model_dirs[arch]
    with LLM(str(path), tensor_parallel_size=tp, pipeline_parallel_size=pp, moe_expert_parallel_size=ep,
             kv_cache_config=KV) as llm:
        assert len(llm.collective_rpc("report_device_id")) == tp * pp
        got = _generate(llm)
    assert got == _hf_tokens(path)


class ReduceProbe:
    def defers_reduce(self) -> bool:
        return self.ctx.defer_reduce


@pytest.mark.parametrize(("arch", "tp", "pp"), [("llama", 2, 2), ("qwen3_moe", 2, 1)])
def test_all_reduce_left_to_the_norms_keeps_greedy_tokens(ray_cluster, tiny_model_dirs, arch, tp, pp):
    """kernel_config.fused_allreduce_norm: the o / down projections return partial sums that the RMSNorm after them
    reduces (on the CPU: all-reduce, then add + norm; the fused kernel is GPU-only); a pipeline stage reduces its
    last layer's output before sending it on; mixture-of-experts blocks reduce their own."""
    path = tiny_model_dirs[arch]
    with LLM(str(path), tensor_parallel_size=tp, pipeline_parallel_size=pp, kv_cache_config=KV,
             kernel_config={"fused_allreduce_norm": True}, worker_extension_cls=ReduceProbe) as llm:
        assert llm.collective_rpc("defers_reduce") == [True] * (tp * pp)
        got = _generate(llm)
    assert got == _hf_tokens(path)


class PipelineProbe:
    def overlaps_pipeline(self) -> bool:
        return self.engine.overlap and self.engine.scheduler.skip_in_flight


@pytest.mark.parametrize(("arch", "tp", "pp"), [("llama", 1, 2), ("llama", 2, 2), ("qwen3_moe", 1, 2)])
def test_overlapped_pipeline_steps_keep_greedy_tokens(ray_cluster, tiny_model_dirs, arch, tp, pp):
    """Overlapped pipeline steps (the default): consecutive steps hold different sequences and the first stage runs
    step N+1 while the last finishes step N; a budget of 16 tokens a step chunks the prompts, so steps overlap from
    the start."""
    path = tiny_model_dirs[arch]
    with LLM(str(path), tensor_parallel_size=tp, pipeline_parallel_size=pp, kv_cache_config=KV, max_num_tokens=16,
             worker_extension_cls=PipelineProbe) as llm:
        assert llm.collective_rpc("overlaps_pipeline", target_ranks=[0]) == [True]
        got = _generate(llm)
    assert got == _hf_tokens(path)


def test_overlapped_pipeline_steps_survive_preemption(ray_cluster, tiny_model_dirs):
    """A cache of 5 blocks for 3 sequences of up to 40 tokens: requests are preempted and recomputed while other
    steps are in flight; the greedy tokens stay HF's. (A request preempted with its draw in flight is re-admitted
    only once the draw arrived: tests/engine/test_scheduler.py.)"""
    path = tiny_model_dirs["llama"]
    with LLM(str(path), pipeline_parallel_size=2, kv_cache_config=KvCacheConfig(max_tokens=80, tokens_per_block=16),
             max_num_tokens=16) as llm:
        got = _generate(llm)
        preempted = sum(entry["inflightBatchingStats"]["numPausedRequests"] for entry in llm.get_stats())
    assert preempted > 0
    assert got == _hf_tokens(path)


@pytest.mark.parametrize("disable_overlap", [True, False], ids=["micro-batches", "overlapped-steps"])
def test_pipeline_micro_batches_keep_prompt_logprobs_and_sampling_exact(ray_cluster, tiny_model_dirs,
                                                                        disable_overlap):
    path = tiny_model_dirs["llama"]
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=5, logprobs=2, prompt_logprobs=1)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in PROMPTS]
    with LLM(str(path), executor="local", kv_cache_config=KV) as single:
        expected = single.generate(prompts, params, use_tqdm=False)
    with LLM(str(path), pipeline_parallel_size=2, kv_cache_config=KV, disable_pipeline_overlap=disable_overlap,
             worker_extension_cls=PipelineProbe) as staged:
        assert staged.collective_rpc("overlaps_pipeline", target_ranks=[0]) == [not disable_overlap]
        got = staged.generate(prompts, params, use_tqdm=False)
    for ours, reference in zip(got, expected):
        assert ours.outputs[0].token_ids == reference.outputs[0].token_ids
        for a, b in zip(ours.prompt_logprobs[1:], reference.prompt_logprobs[1:]):
            assert {t: round(v.logprob, 4) for t, v in a.items()} == {t: round(v.logprob, 4) for t, v in b.items()}


def test_ray_executor_is_chosen_when_a_cluster_is_up_and_matches_local(ray_cluster, tiny_model_dirs):
    path = tiny_model_dirs["qwen3"]
    with LLM(str(path), kv_cache_config=KV) as auto:
        assert type(auto._executor).__name__ == "RayExecutor"
        via_ray = _generate(auto)
    with LLM(str(path), executor="local", kv_cache_config=KV) as local:
        assert via_ray == _generate(local)


def test_collective_rpc_target_ranks_and_unique_reply(ray_cluster, tiny_model_dirs):
    with LLM(str(tiny_model_dirs["llama"]), tensor_parallel_size=2, kv_cache_config=KV) as llm:
        everyone = llm.collective_rpc("report_device_id")
        assert len(set(everyone)) == 2
        assert llm.collective_rpc("report_device_id", target_ranks=[1]) == everyone[1:]
        assert llm.collective_rpc("report_device_id", target_ranks=1) == everyone[1:]
        assert llm.collective_rpc("report_device_id", unique_reply_rank=1) == everyone[1:]
        with pytest.raises(ValueError, match="target_ranks"):
            llm.collective_rpc("report_device_id", target_ranks=[2])
        with pytest.raises(ValueError, match="no method"):
            llm.collective_rpc("_private")


def _alive_workers(ray_module) -> list:
    from ray.util.state import list_actors

    return [a for a in list_actors(address=ray_module.get_runtime_context().gcs_address,
                                   filters=[("state", "=", "ALIVE")]) if a.class_name == "RayWorker"]


def _live_groups() -> list:
    return [g for g in cluster_placement_groups() if g.state != "REMOVED"]


def _assert_workers_and_groups_gone(ray_module, timeout: float = 10.0) -> None:
    """Every RayWorker actor and placement group is gone within `timeout` seconds (shutdown is asynchronous)."""
    deadline = time.time() + timeout
    while (_alive_workers(ray_module) or _live_groups()) and time.time() < deadline:
        time.sleep(0.2)
    assert _alive_workers(ray_module) == [] and _live_groups() == []


def test_shutdown_leaves_no_actors_or_placement_groups_and_two_engines_coexist(ray_cluster, tiny_model_dirs):
    first = LLM(str(tiny_model_dirs["llama"]), tensor_parallel_size=2, kv_cache_config=KV)
    second = LLM(str(tiny_model_dirs["qwen2"]), pipeline_parallel_size=2, kv_cache_config=KV)
    assert len(_alive_workers(ray_cluster)) == 4
    assert _generate(first) == _hf_tokens(tiny_model_dirs["llama"])
    assert _generate(second) == _hf_tokens(tiny_model_dirs["qwen2"])
    first.shutdown()
    second.shutdown()
    _assert_workers_and_groups_gone(ray_cluster)


def test_killing_a_worker_fails_requests_quickly_and_health_reports_it(ray_cluster, tiny_model_dirs):
    llm = LLM(str(tiny_model_dirs["llama"]), tensor_parallel_size=2, kv_cache_config=KV)
    try:
        llm.check_health()
        running = llm.generate_async([5, 6, 7], SamplingParams(max_tokens=2000, ignore_eos=True))
        time.sleep(1.0)
        killed_at = time.time()
        ray_cluster.kill(llm._executor.actors[1])
        # Either the driver sees the dead actor first, or rank 0's collective breaks: both fail the request.
        with pytest.raises(RuntimeError, match="worker 1|Connection|engine step failed"):
            running.result(timeout=30)
        assert time.time() - killed_at < 10
        with pytest.raises(RuntimeError, match="not running"):
            llm.check_health()
        with pytest.raises(RuntimeError, match="not running"):
            llm.generate([1, 2, 3])
    finally:
        llm.shutdown()
    _assert_workers_and_groups_gone(ray_cluster)


def test_dummy_weights_are_one_model_across_parallel_layouts(ray_cluster, tiny_model_dirs):
    """--load_format dummy draws each checkpoint tensor whole and narrows it, so TP=2 and PP=2 run the same
    random model as one rank (what the multi-GPU parity runs on the 8B shape rely on)."""
    path = str(tiny_model_dirs["llama"])
    outputs = []
    for layout in ({"executor": "local"}, {"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}):
        with LLM(path, load_format="dummy", skip_tokenizer_init=True, kv_cache_config=KV, **layout) as llm:
            outputs.append(_generate(llm))
    assert outputs[1] == outputs[0] and outputs[2] == outputs[0]


def test_tensor_parallel_steps_overlap_and_match_one_rank(ray_cluster, tiny_model_dirs):
    """With one pipeline stage, rank 0 launches step N+1 before step N's draws reach the host; the other rank
    gets the placeholder tokens from rank 0's device. Seeded sampling and greedy match one rank, overlap off."""
    path = str(tiny_model_dirs["llama"])
    prompts = [TokensPrompt(prompt_token_ids=p) for p in PROMPTS]
    params = [SamplingParams(max_tokens=NEW_TOKENS, temperature=0.9, seed=3, logprobs=1),
              SamplingParams(max_tokens=NEW_TOKENS), SamplingParams(max_tokens=5, top_k=4, seed=1)]
    with LLM(path, executor="local", kv_cache_config=KV, disable_overlap_scheduler=True) as single:
        expected = single.generate(prompts, params, use_tqdm=False)
    with LLM(path, tensor_parallel_size=2, kv_cache_config=KV, worker_extension_cls=OverlapProbe) as llm:
        assert llm.collective_rpc("engine_overlaps", target_ranks=0) == [True]
        got = llm.generate(prompts, params, use_tqdm=False)
    for ours, reference in zip(got, expected):
        assert ours.outputs[0].token_ids == reference.outputs[0].token_ids
        for mine, theirs in zip(ours.outputs[0].logprobs or [], reference.outputs[0].logprobs or []):
            assert mine.keys() == theirs.keys()
            assert all(abs(mine[t].logprob - theirs[t].logprob) < 1e-4 for t in mine)


def test_kernel_config_reaches_every_worker(ray_cluster, tiny_model_dirs):
    """kernel_config travels to every Ray worker in its WorkerSpec (no environment variable is forwarded)."""
    with LLM(str(tiny_model_dirs["llama"]), tensor_parallel_size=2, kv_cache_config=KV,
             kernel_config={"pdl": "exit", "fused_allreduce_norm": False}, worker_extension_cls=OverlapProbe) as llm:
        assert llm.collective_rpc("kernel_choice") == [("exit", False), ("exit", False)]


class GraphStandIn:
    """Installs on every rank a stand-in for the decode graphs (tests/engine/test_graph_outputs.py): the eager
    decode, returning its logits and greedy draws as a replay does, so that no rank launches the LM head (and at
    TP > 1 its all-gather) after it."""

    def install_graph_stand_in(self) -> None:
        from raylm.engine.cuda_graphs import DecodeOutputs
        from raylm.engine.sampler import greedy_draws
        from raylm.engine.step_plan import StepPlan

        runner = self.runner

        class EagerGraphs:
            steps = 0
            captured = False  # steps prepare their LoRA rows as eager ones do

            def fits(self, num_seqs, max_blocks):
                return True

            def run_step(self, input_ids, positions, slot_mapping, contexts, feed=None, greedy=False, lora_slots=None):
                self.steps += 1
                runner.graphs = None
                try:
                    hidden = runner.forward(StepPlan(input_ids=input_ids, positions=positions,
                                                     slot_mapping=slot_mapping, decode_contexts=contexts), feed=feed)
                finally:
                    runner.graphs = self
                logits = runner.model.compute_logits(hidden)
                return DecodeOutputs(hidden, logits, greedy_draws(logits) if greedy else None)

        runner.graphs = EagerGraphs()
        from raylm.actors.transport import Communicator

        broadcast_feed, self.feed_broadcasts = Communicator.broadcast_feed, 0

        def counted(comm, *args):  # this rank's process is this worker's alone
            self.feed_broadcasts += 1
            return broadcast_feed(comm, *args)

        Communicator.broadcast_feed = counted

    def graph_steps(self) -> tuple[int, int]:
        return self.runner.graphs.steps, self.feed_broadcasts


def _mixed(llm: LLM) -> list:
    params = [SamplingParams(max_tokens=NEW_TOKENS, logprobs=1), SamplingParams(max_tokens=9, temperature=0.8, seed=5),
              SamplingParams(max_tokens=7, repetition_penalty=1.4)]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [sorted((t, lp.logprob) for t, lp in step.items())
                                      for step in o.outputs[0].logprobs or []]) for o in outputs]


def _assert_same_mixed(got: list, expected: list) -> None:
    """Tokens equal, log-probabilities within 1e-4: how the requests fall into steps depends on their arrival,
    and a step's shape moves the last bits (rounding both sides to 4 places flipped a digit at times)."""
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
    for (_, ours), (_, reference) in zip(got, expected):
        assert [[t for t, _ in step] for step in ours] == [[t for t, _ in step] for step in reference]
        flat = [lp for step in ours for _, lp in step]
        assert flat == pytest.approx([lp for step in reference for _, lp in step], abs=1e-4)


def test_graph_logits_and_draws_at_tp2_keep_tokens(ray_cluster, tiny_model_dirs):
    """Every rank takes the logits its decode graph computed (all-gathered inside it) instead of computing them
    after it, together (a rank that all-gathered alone would hang or mix steps); a greedy step's input tokens
    come from each rank's own graph draws, not from rank 0's broadcast (a step after an eager one, with a prefill,
    still takes them by broadcast: the requests' arrival decides how many there are); sampled and penalised rows
    give what they give without graphs."""
    path = tiny_model_dirs["llama"]
    with LLM(str(path), tensor_parallel_size=2, kv_cache_config=KV) as llm:
        mixed = _mixed(llm)
    with LLM(str(path), tensor_parallel_size=2, kv_cache_config=KV, worker_extension_cls=GraphStandIn) as llm:
        llm.collective_rpc("install_graph_stand_in")
        got = _generate(llm)
        (steps, broadcasts), (peer_steps, peer_broadcasts) = llm.collective_rpc("graph_steps")
        _assert_same_mixed(_mixed(llm), mixed)
    assert steps == peer_steps >= NEW_TOKENS - 1
    assert broadcasts == peer_broadcasts < 4  # of the 15 fed steps
    assert got == _hf_tokens(path)


def test_a_worker_prints_its_stacks_on_sigusr1(ray_cluster, tiny_model_dirs):
    """`kill -USR1` on a worker writes every thread's Python stack to its Ray log (how benchmarks/h200.sh shows
    where each rank waits in a command that ran out of time), and the worker carries on."""
    import os
    import signal

    import ray

    logs = os.path.join(ray._private.worker.global_worker.node.get_session_dir_path(), "logs")
    with LLM(str(tiny_model_dirs["llama"]), pipeline_parallel_size=2, kv_cache_config=KV) as llm:
        pids = [int(device.rsplit("-", 1)[1]) for device in llm.collective_rpc("report_device_id")]
        for pid in pids:
            os.kill(pid, signal.SIGUSR1)
        stacks = {}
        deadline = time.monotonic() + 30
        # A dump is written thread by thread: read again until rank 1's waiting thread is in it, or time is up.
        while time.monotonic() < deadline and not (len(stacks) == len(pids)
                                                   and "worker_loop" in stacks[pids[1]]):
            for pid in pids:
                for name in os.listdir(logs):
                    if name.startswith("worker-") and name.endswith(f"-{pid}.err"):
                        with open(os.path.join(logs, name)) as log:
                            text = log.read()
                        if "most recent call first" in text:
                            stacks[pid] = text
            time.sleep(0.2)
        assert len(stacks) == len(pids)
        assert "worker_loop" in stacks[pids[1]]  # rank 1 waits for rank 0's next plan
        assert _generate(llm) == _hf_tokens(tiny_model_dirs["llama"])


class FailingForward:
    """Makes rank 0's next forward raise, after the step's plan has gone to the other ranks."""

    def fail_next_forward(self) -> None:
        runner = self.engine.runner.runner
        forward = runner.forward

        def failing(*args, **kwargs):
            runner.forward = forward
            raise RuntimeError("injected forward failure")

        runner.forward = failing


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_a_step_failing_on_rank_0_after_its_plan_went_out_stops_the_engine(ray_cluster, tiny_model_dirs, tp, pp):
    """The other ranks already run (or wait in) that step, so their collectives no longer pair up with rank 0's:
    the engine stops with a clear error instead of going on out of step (which hangs or computes garbage), its
    requests fail quickly, health reports it, and shutdown still releases every worker."""
    llm = LLM(str(tiny_model_dirs["llama"]), tensor_parallel_size=tp, pipeline_parallel_size=pp, kv_cache_config=KV,
              worker_extension_cls=FailingForward)
    try:
        assert _generate(llm) == _hf_tokens(tiny_model_dirs["llama"])
        llm.collective_rpc("fail_next_forward", target_ranks=[0])
        started = time.time()
        with pytest.raises(RuntimeError, match="other ranks had started it.*injected forward failure"):
            llm.generate([5, 6, 7], SamplingParams(max_tokens=8))
        assert time.time() - started < 10
        with pytest.raises(RuntimeError, match="not running"):
            llm.check_health()
    finally:
        llm.shutdown()
    _assert_workers_and_groups_gone(ray_cluster)


def test_structured_output_at_tp2_matches_one_rank(ray_cluster, tiny_model_dirs):
    import re

    from raylm import GuidedDecodingParams

    path = tiny_model_dirs["llama"]
    if not (path / "tokenizer.json").exists():
        pytest.skip("the tiny models have no tokenizer without the embedded SmolLM2")
    pattern = "[a-z]{3}-[0-9]{3}"
    params = SamplingParams(max_tokens=16, guided_decoding=GuidedDecodingParams(regex=pattern))
    with LLM(str(path), tensor_parallel_size=2, kv_cache_config=KV) as llm:
        two = [o.outputs[0].text for o in llm.generate(["Code:", "Id:"], params)]
    with LLM(str(path), executor="local", kv_cache_config=KV) as llm:
        one = [o.outputs[0].text for o in llm.generate(["Code:", "Id:"], params)]
    assert two == one and all(re.fullmatch(pattern, text) for text in two)
