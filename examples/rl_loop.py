"""A GRPO-style RL loop: a trainer actor and an AsyncLLM engine in one placement group.

Each iteration: rollouts (several samples a prompt, with the log-probabilities of the sampled tokens) ->
pause_generation -> release of the engine's device memory (its weights discarded: the refit brings new ones) ->
a few optimizer steps on a toy reward (shorter answers score higher) -> resume of the weights -> update_weights
from one flat bucket of the trainer's weights -> a new weight version -> resume of the KV cache and the rest ->
resume_generation. It prints the phases' times and the largest gap between the trainer's and the engine's
log-probability of a sampled token under the same weights, which stays at float precision (fp32) if refits are
exact.

    python examples/rl_loop.py                        # CPU, the embedded SmolLM2-135M-Instruct
    python examples/rl_loop.py --model path/to/hf-dir --iterations 5

On a GPU the trainer and the engine share it (half each); the weights travel as CUDA IPC handles.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raylm import AsyncLLM, SamplingParams
from raylm.models.source import resolve_model

PROMPTS = ["Tell me about the sea.", "What is a good breakfast?", "Describe a cat.", "Why is the sky blue?"]


@ray.remote
class Trainer:
    """The policy being trained: HF transformers' model of the same checkpoint, in float32."""

    def __init__(self, model_dir: str, device: str, learning_rate: float):
        from transformers import AutoModelForCausalLM

        # CPU tensors reach the engine's processes through files (rl_api/weight_transfer.py).
        torch.multiprocessing.set_sharing_strategy("file_system")
        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(self.device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=learning_rate)
        self.bucket = None  # the last weights handed out, kept alive until the engine has copied them

    def _token_logprobs(self, prompt_ids: list[int], completion_ids: list[int]) -> torch.Tensor:
        ids = torch.tensor([prompt_ids + completion_ids], device=self.device)
        logprobs = torch.log_softmax(self.model(ids).logits[0, :-1].float(), dim=-1)
        targets = ids[0, 1:]
        return logprobs.gather(1, targets[:, None])[len(prompt_ids) - 1:, 0]

    @torch.no_grad()
    def logprobs(self, samples: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        """The log-probability of each sampled token under the current weights."""
        return [self._token_logprobs(prompt, completion).tolist() for prompt, completion in samples]

    def train(self, samples: list[tuple[list[int], list[int], float]], steps: int) -> float:
        """Policy-gradient steps: each sample's advantage times the log-probability of its tokens."""
        self.model.train()
        for _ in range(steps):
            self.optimizer.zero_grad()
            loss = sum(-advantage * self._token_logprobs(prompt, completion).sum()
                       for prompt, completion, advantage in samples) / len(samples)
            loss.backward()
            self.optimizer.step()
        self.model.eval()
        return float(loss.detach())

    def weights(self) -> str:
        """All weights as one flat bucket behind one handle, encoded for update_weights."""
        from raylm.rl_api.weight_transfer import encode_payload, pack_bucket

        named = [(name, param.detach()) for name, param in self.model.named_parameters()]
        self.bucket = pack_bucket(named)
        return encode_payload(self.bucket.payload())


def rewards(completions: list[list[int]], max_tokens: int) -> list[float]:
    """The toy reward: shorter answers score higher."""
    return [1.0 - len(tokens) / max_tokens for tokens in completions]


async def iteration(llm: AsyncLLM, trainer, devices: list[str], args) -> dict[str, float]:
    times = {}
    begin = time.perf_counter()
    params = SamplingParams(n=args.samples, temperature=1.0, max_tokens=args.max_tokens, logprobs=0)
    outputs = await asyncio.gather(*(llm.generate_async(prompt, params) for prompt in PROMPTS))
    samples = [(output.prompt_token_ids, completion.token_ids, [
        step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids)])
        for output in outputs for completion in output.outputs]
    times["rollout"] = time.perf_counter() - begin

    begin = time.perf_counter()
    trainer_logprobs = await trainer.logprobs.remote([(prompt, tokens) for prompt, tokens, _ in samples])
    gap = max((abs(a - b) for (_, _, ours), theirs in zip(samples, trainer_logprobs) for a, b in zip(ours, theirs)),
              default=0.0)
    scores = rewards([tokens for _, tokens, _ in samples], args.max_tokens)
    mean = sum(scores) / len(scores)
    times["score"] = time.perf_counter() - begin

    begin = time.perf_counter()
    await llm.pause_generation()
    await llm.release(["kv_cache", "cuda_graph", "model", "model_weights"])
    times["release"] = time.perf_counter() - begin

    begin = time.perf_counter()
    loss = await trainer.train.remote([(prompt, tokens, score - mean) for (prompt, tokens, _), score
                                       in zip(samples, scores)], args.train_steps)
    times["train"] = time.perf_counter() - begin

    begin = time.perf_counter()
    await llm.resume(["model_weights"])
    payload = await trainer.weights.remote()
    await llm.update_weights({device: payload for device in devices})
    await llm.update_weights(None)
    times["refit"] = time.perf_counter() - begin

    begin = time.perf_counter()
    await llm.resume(["kv_cache", "cuda_graph", "model"])
    await llm.resume_generation()
    times["resume"] = time.perf_counter() - begin
    return {**times, "reward": mean, "loss": loss, "logprob_gap": gap}


async def main(args) -> None:
    gpu = torch.cuda.is_available()
    ray.init()
    bundles = [{"GPU": 1, "CPU": 2}] if gpu else [{"CPU": 1}, {"CPU": 1}]
    group = placement_group(bundles, strategy="PACK")
    await group.ready()
    model_dir = str(resolve_model(args.model).config_dir)
    trainer = Trainer.options(num_cpus=1 if not gpu else 1, num_gpus=0.5 if gpu else 0,
                              scheduling_strategy=PlacementGroupSchedulingStrategy(group, 0)).remote(
        model_dir, "cuda" if gpu else "cpu", args.learning_rate)
    engine_bundle = 0 if gpu else 1
    async with AsyncLLM(placement_groups=[group], placement_bundle_indices=[[engine_bundle]],
                        per_worker_gpu_share=0.5 if gpu else None, model=args.model, dtype="float32",
                        max_seq_len=512, sleep_config={"model_weights": "discard"}) as llm:
        devices = await llm.collective_rpc("report_device_id")
        print(f"{'iter':>4} {'rollout s':>9} {'score s':>8} {'release s':>9} {'train s':>8} {'refit s':>8} "
              f"{'resume s':>8} {'reward':>7} {'loss':>8} {'max |logprob gap|':>18} weight version")
        for step in range(args.iterations):
            row = await iteration(llm, trainer, devices, args)
            print(f"{step:>4} {row['rollout']:>9.2f} {row['score']:>8.2f} {row['release']:>9.3f} {row['train']:>8.2f} "
                  f"{row['refit']:>8.2f} {row['resume']:>8.3f} {row['reward']:>7.3f} {row['loss']:>8.3f} "
                  f"{row['logprob_gap']:>18.2e} {llm.weight_version}")
    ray.kill(trainer)
    remove_placement_group(group)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF directory, .gguf or hub id (default: embedded SmolLM2)")
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--samples", type=int, default=4, help="samples per prompt")
    parser.add_argument("--max_tokens", type=int, default=24)
    parser.add_argument("--train_steps", type=int, default=2)
    parser.add_argument("--learning_rate", type=float, default=1e-5)
    asyncio.run(main(parser.parse_args()))
