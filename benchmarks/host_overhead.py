"""Host work per engine step, without the model's cost: a 1-layer, hidden-16 Llama with random weights (made once
under the cache directory) runs B sequences of 16 prompt tokens for O steps in one process; tokens/s and ms per
step then measure the engine's own Python (scheduling, planning, sampling bookkeeping, applying draws, the
driver's output processing), which bounds throughput at large batches on any device.

    python benchmarks/host_overhead.py --batch_size 512 --output_len 64
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import write_result  # noqa: E402

NULL_MODEL = Path(os.environ.get("RAYLM_CACHE_DIR", Path.home() / ".cache" / "raylm")) / "null-llama-v1"


def null_model() -> Path:
    """A 1-layer Llama with hidden size 16 and a 512-token vocabulary: its forward costs next to nothing."""
    if not (NULL_MODEL / "config.json").exists():
        import torch
        from transformers import AutoModelForCausalLM, LlamaConfig

        config = LlamaConfig(vocab_size=512, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(NULL_MODEL)
    return NULL_MODEL


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch_size", type=int, default=512)
    parser.add_argument("--output_len", type=int, default=64)
    parser.add_argument("--num_iters", type=int, default=3)
    parser.add_argument("--output_json", default=None)
    args = parser.parse_args()

    from raylm import LLM, KvCacheConfig, SamplingParams, TokensPrompt

    batch, steps = args.batch_size, args.output_len
    llm = LLM(str(null_model()), skip_tokenizer_init=True, load_format="dummy", max_batch_size=batch,
              max_seq_len=16 + steps + 16, kv_cache_config=KvCacheConfig(max_tokens=max(batch * (steps + 32), 1024)))
    rng = random.Random(0)
    prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(10, 500) for _ in range(16)]) for _ in range(batch)]
    params = SamplingParams(max_tokens=steps, ignore_eos=True)
    llm.generate(prompts[:4], params, use_tqdm=False)  # warm-up
    times = []
    for _ in range(args.num_iters):
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - start)
    llm.shutdown()
    median = statistics.median(times)
    result = {"elapsed_s": times, "ms_per_step": 1000 * median / steps, "tokens_per_s": batch * steps / median}
    path = write_result(f"host-overhead-b{batch}-o{steps}-cpu", args, result)
    print(f"batch {batch}, {steps} steps: {result['ms_per_step']:.2f} ms per step, {result['tokens_per_s']:.0f} tok/s "
          f"(median of {args.num_iters}); wrote {path}")


if __name__ == "__main__":
    main()
