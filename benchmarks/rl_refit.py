"""The RL loop's device-side costs: a full refit through bucketed IPC handles from a trainer process colocated on the
engine's device, and the release and resume of the engine's memory, as an RL trainer drives them through AsyncLLM.

A trainer actor (half the GPU) holds the model's weights under their checkpoint names; an AsyncLLM engine (the other
half) runs in the same placement group. Measured:
- refit: the trainer packs every weight into flat buckets (--bucket_mb each) and the engine copies them in from one
  handle per bucket (update_weights, then update_weights(None)); the first refit apart, the median of --refits;
  the weights are then checked to be exact: greedy tokens after refits A, B, A again equal the first A's;
- the RL cycle, --cycles times: release of the --tags (every tag by default), resume of the weights, a refit
  (sleep_config.model_weights discard, the default here) or nothing (host_copy), resume of the rest (the decode
  graphs are captured again unless addresses are kept and cuda_graph is not released), then greedy tokens compared
  bit for bit with those before; device memory by mem_get_info before and after the release, and what the engine's
  process still holds (the driver's count, through NVML);
- each tag released alone: the device memory it returned against the bytes it held.

    python benchmarks/rl_refit.py --model benchmarks/configs/llama-3.1-8b --load_format dummy --dtype bfloat16
    python benchmarks/rl_refit.py            # CPU, the embedded SmolLM2-135M-Instruct: the same path, shared memory
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import add_model_args, llm_options, random_prompts, run_suffix, write_result  # noqa: E402

TAGS = ["model_weights", "kv_cache", "cuda_graph", "model"]


@ray.remote
class Trainer:
    """Stands in for a trainer: the model's weights under checkpoint names, on its share of the device."""

    def __init__(self, model_dir: str, device: str, dtype: str):
        from transformers import AutoConfig

        from raylm.models.weight_update import checkpoint_shapes

        torch.multiprocessing.set_sharing_strategy("file_system")  # CPU tensors reach the engine through files
        self.device = torch.device(device)
        self.dtype = getattr(torch, dtype)
        self.shapes = checkpoint_shapes(AutoConfig.from_pretrained(model_dir))
        self.weights: list[tuple[str, torch.Tensor]] = []
        self.buckets = []  # the last buckets handed out, alive until the engine has copied them

    def make_weights(self, seed: int) -> float:
        """Fresh weights (normal, std 0.02; norms at 1) drawn from `seed`; returns their GiB."""
        generator = torch.Generator(self.device).manual_seed(seed)
        self.weights = []
        for name, shape in self.shapes.items():
            if name.endswith("norm.weight"):
                tensor = torch.ones(shape, dtype=self.dtype, device=self.device)
            else:
                tensor = torch.randn(shape, generator=generator, device=self.device, dtype=torch.float32)
                tensor = (tensor * 0.02).to(self.dtype)
            self.weights.append((name, tensor))
        return sum(t.nbytes for _, t in self.weights) / 2**30

    def pack(self, bucket_bytes: int) -> tuple[str, int, float]:
        """Every weight in buckets of about `bucket_bytes`; returns their payloads (encoded as update_weights and
        /update_weights take them: CPU buffers go to shared memory), how many, and the seconds packing took."""
        from raylm.rl_api.weight_transfer import encode_payload, pack_bucket

        self.buckets = []
        if self.device.type == "cuda":
            torch.cuda.ipc_collect()  # frees the buckets the engine has let go of
        begin = time.perf_counter()
        group, size = [], 0
        for name, tensor in self.weights:
            group.append((name, tensor))
            size += tensor.nbytes
            if size >= bucket_bytes:
                self.buckets.append(pack_bucket(group))
                group, size = [], 0
        if group:
            self.buckets.append(pack_bucket(group))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        payload = encode_payload([bucket.payload() for bucket in self.buckets])
        return payload, len(self.buckets), time.perf_counter() - begin


async def refit(llm, trainer, devices: list[str], bucket_bytes: int) -> dict[str, float]:
    begin = time.perf_counter()
    payload, buckets, pack_s = await trainer.pack.remote(bucket_bytes)
    await llm.update_weights({device: payload for device in devices})
    await llm.update_weights(None)
    total = time.perf_counter() - begin
    return {"total_s": total, "pack_s": pack_s, "copy_s": total - pack_s, "buckets": buckets}


async def greedy(llm, prompt: list[int], tokens: int) -> list[int]:
    from raylm import SamplingParams, TokensPrompt

    output = await llm.generate_async(TokensPrompt(prompt_token_ids=prompt),
                                      SamplingParams(max_tokens=tokens, ignore_eos=True))
    return list(output.outputs[0].token_ids)


async def memory(llm) -> dict:
    """Rank 0's memory status (engine/device_memory.py by tag; on GPUs the device's free bytes)."""
    return (await llm.get_memory_status())[0]


def tag_bytes(status: dict, tags: list[str]) -> int:
    return sum(status["tags"][tag]["bytes"] for tag in tags)


async def timed(call) -> float:
    begin = time.perf_counter()
    await call
    return time.perf_counter() - begin


async def run(args) -> dict:
    from raylm import AsyncLLM
    from raylm.models.source import resolve_model

    gpu = torch.cuda.is_available() and args.device != "cpu"
    bundles = [{"GPU": 1, "CPU": 2}] if gpu else [{"CPU": 1}, {"CPU": 1}]
    group = placement_group(bundles, strategy="PACK")
    await group.ready()
    source = resolve_model(args.model)
    options = llm_options(args, args.max_seq_len)
    options.setdefault("sleep_config", {}).setdefault("model_weights", "discard")
    discard = options["sleep_config"]["model_weights"] == "discard"
    dtype = options["dtype"] if options["dtype"] != "auto" else ("bfloat16" if gpu else "float32")
    options["dtype"] = dtype
    trainer = Trainer.options(num_cpus=1, num_gpus=0.5 if gpu else 0,
                              scheduling_strategy=PlacementGroupSchedulingStrategy(group, 0)).remote(
        str(source.config_dir), "cuda" if gpu else "cpu", dtype)
    weights_a = trainer.make_weights.remote(args.seed)
    llm = AsyncLLM(placement_groups=[group], placement_bundle_indices=[[0 if gpu else 1]],
                   per_worker_gpu_share=0.5 if gpu else None, **options)
    begin = time.perf_counter()
    await llm
    result: dict = {"engine_start_s": time.perf_counter() - begin, "weights_gib": await weights_a,
                    "sleep_config.model_weights": options["sleep_config"]["model_weights"]}
    status = await memory(llm)
    result["keep_addresses"] = status["keep_addresses"]
    print(f"engine up in {result['engine_start_s']:.1f} s; addresses kept: {status['keep_addresses']}", flush=True)
    bucket_bytes = args.bucket_mb * 2**20
    devices = await llm.collective_rpc("report_device_id")
    prompt = random_prompts(1, args.input_len, 2000, args.seed)[0]  # ids 1000..1999: in every vocabulary

    first = await refit(llm, trainer, devices, bucket_bytes)
    tokens_a = await greedy(llm, prompt, args.output_len)
    refits = [await refit(llm, trainer, devices, bucket_bytes) for _ in range(args.refits)]
    result["refit"] = {"first": first, "runs": refits,
                       "median_total_s": statistics.median(r["total_s"] for r in refits),
                       "median_pack_s": statistics.median(r["pack_s"] for r in refits),
                       "median_copy_s": statistics.median(r["copy_s"] for r in refits)}
    print(f"refit: {result['refit']['median_total_s']:.3f} s (pack {result['refit']['median_pack_s']:.3f} s, copy "
          f"{result['refit']['median_copy_s']:.3f} s, {first['buckets']} buckets), first {first['total_s']:.3f} s",
          flush=True)
    same_after_refits = await greedy(llm, prompt, args.output_len) == tokens_a
    await trainer.make_weights.remote(args.seed + 1)
    await refit(llm, trainer, devices, bucket_bytes)
    tokens_b = await greedy(llm, prompt, args.output_len)
    await trainer.make_weights.remote(args.seed)
    await refit(llm, trainer, devices, bucket_bytes)
    result["refit"]["exact"] = {"same_tokens_after_refits": same_after_refits,
                                "other_weights_change_tokens": tokens_b != tokens_a,
                                "same_tokens_after_refit_back": await greedy(llm, prompt, args.output_len) == tokens_a}
    print(f"refit exactness: {result['refit']['exact']}", flush=True)

    cycles = []
    for _ in range(args.cycles):
        await llm.pause_generation()
        before = await memory(llm)
        cycle = {"release_s": await timed(llm.release(args.tags))}
        after = await memory(llm)
        if discard and "model_weights" in args.tags:
            cycle["resume_weights_s"] = await timed(llm.resume(["model_weights"]))
            cycle["refit_s"] = (await refit(llm, trainer, devices, bucket_bytes))["total_s"]
            cycle["resume_rest_s"] = await timed(llm.resume([tag for tag in args.tags if tag != "model_weights"]))
        else:
            cycle["resume_s"] = await timed(llm.resume(args.tags))
        await llm.resume_generation()
        cycle["same_tokens"] = await greedy(llm, prompt, args.output_len) == tokens_a
        cycle["held_bytes"] = tag_bytes(before, args.tags)
        cycle["held_bytes_all_tags"] = tag_bytes(before, TAGS)
        if gpu:
            cycle["returned_bytes"] = after["device_free_bytes"] - before["device_free_bytes"]
            cycle["returned_fraction"] = cycle["returned_bytes"] / cycle["held_bytes"]
            cycle["left"] = {key: after[key] for key in ("process_allocated_bytes", "process_reserved_bytes",
                                                         "process_device_bytes")}
        cycles.append(cycle)
        print(f"cycle: {cycle}", flush=True)
    result["cycles"] = cycles

    await llm.pause_generation()
    by_tag = {}
    for tag in ["kv_cache", "cuda_graph", "model", "model_weights"]:
        before = await memory(llm)
        seconds = await timed(llm.release([tag]))
        after = await memory(llm)
        by_tag[tag] = {"held_bytes": tag_bytes(before, [tag]), "release_s": seconds}
        if gpu:
            by_tag[tag]["returned_bytes"] = after["device_free_bytes"] - before["device_free_bytes"]
    result["release_by_tag"] = by_tag
    print(f"release by tag: {by_tag}", flush=True)
    await llm.resume(["model_weights"])
    if discard:
        await refit(llm, trainer, devices, bucket_bytes)
    await llm.resume(TAGS)
    await llm.resume_generation()
    result["same_tokens_after_tag_releases"] = await greedy(llm, prompt, args.output_len) == tokens_a
    llm.shutdown()
    ray.kill(trainer)
    remove_placement_group(group)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, peer=False)
    parser.set_defaults(kv_cache_max_tokens=16384, max_batch_size=64)
    parser.add_argument("--bucket_mb", type=int, default=1024, help="bytes per bucket, in MiB")
    parser.add_argument("--refits", type=int, default=5)
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--tags", nargs="+", default=TAGS, choices=TAGS, help="the tags each cycle releases")
    parser.add_argument("--input_len", type=int, default=32)
    parser.add_argument("--output_len", type=int, default=32)
    parser.add_argument("--max_seq_len", type=int, default=2048)
    args = parser.parse_args()
    ray.init()
    result = asyncio.run(run(args))
    tags = "" if set(args.tags) == set(TAGS) else "-" + "-".join(args.tags)
    name = f"rl_refit-{Path(args.model or 'smollm2').name}{tags}{run_suffix(args)}"
    print(f"wrote {write_result(name, args, result)}")


if __name__ == "__main__":
    main()
