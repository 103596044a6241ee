"""Multi-LoRA's cost: batch B decode where every request has its own adapter, against the same batch on an engine
without adapters; and the time a new adapter takes to load. The adapters are random PEFT adapters of rank R on
q/k/v/o/gate/up/down, made for the model's shapes (so --load_format dummy works for large shapes).

    python benchmarks/lora.py --batch_size 8 --rank 16
    python benchmarks/lora.py --model benchmarks/configs/llama-3.1-8b --load_format dummy --batch_size 8 --rank 16
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import add_model_args, build_llm, random_prompts, run_suffix, write_result  # noqa: E402

_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_random_adapter(directory: Path, hf_config, rank: int, seed: int) -> None:
    """A PEFT LoRA adapter of `rank` on every projection of every layer, random A and B (B non-zero, so it
    changes the outputs), in the files PEFT saves."""
    from safetensors.torch import save_file

    hidden = hf_config.hidden_size
    head_dim = getattr(hf_config, "head_dim", None) or hidden // hf_config.num_attention_heads
    shapes = {"q_proj": (hidden, hf_config.num_attention_heads * head_dim),
              "k_proj": (hidden, hf_config.num_key_value_heads * head_dim),
              "v_proj": (hidden, hf_config.num_key_value_heads * head_dim),
              "o_proj": (hf_config.num_attention_heads * head_dim, hidden),
              "gate_proj": (hidden, hf_config.intermediate_size), "up_proj": (hidden, hf_config.intermediate_size),
              "down_proj": (hf_config.intermediate_size, hidden)}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(hf_config.num_hidden_layers):
        for module in _MODULES:
            part = "self_attn" if module.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            fan_in, fan_out = shapes[module]
            prefix = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=generator) / fan_in**0.5
                                                  ).to(torch.bfloat16)
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=generator) / rank
                                                  ).to(torch.bfloat16)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(_MODULES),
        "lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM"}))


def timed_runs(llm, prompts, output_len: int, lora_requests, iters: int) -> tuple[list[float], list[float]]:
    """The batch's whole latency `iters` times, then its prefill's alone (one output token; the prefix cache is
    off, so each run computes the prompts again)."""
    from raylm import SamplingParams, TokensPrompt

    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    runs = []
    for tokens in (output_len, 1):
        params = SamplingParams(max_tokens=tokens, ignore_eos=True)
        llm.generate(inputs, params, use_tqdm=False, lora_request=lora_requests)  # warm-up (loads the adapters)
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            llm.generate(inputs, params, use_tqdm=False, lora_request=lora_requests)
            times.append(time.perf_counter() - start)
        runs.append(times)
    return runs[0], runs[1]


def progress(begin: float, text: str) -> None:
    """A line as each phase ends (seconds since `begin`): a run cut off by its time limit shows where it was."""
    print(f"[{time.perf_counter() - begin:7.1f} s] {text}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, peer=False)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--input_len", type=int, default=32)
    parser.add_argument("--output_len", type=int, default=128)
    parser.add_argument("--num_iters", type=int, default=3)
    args = parser.parse_args()

    from raylm import LoraConfig, LoRARequest
    from raylm.models.loader import load_hf_config
    from raylm.models.source import resolve_model

    hf_config = load_hf_config(resolve_model(args.model), False)
    max_seq_len = args.input_len + args.output_len + 16
    result = {}
    begin = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        adapters = []
        for index in range(args.batch_size + 1):  # one more, to time a load
            path = Path(scratch) / f"adapter-{index}"
            write_random_adapter(path, hf_config, args.rank, seed=index)
            adapters.append(LoRARequest(f"adapter-{index}", index + 1, str(path)))
        llm = build_llm(args, max_seq_len=max_seq_len)
        progress(begin, "engine without LoRA started")
        prompts = random_prompts(args.batch_size, args.input_len, llm.info.vocab_size, args.seed)
        base = timed_runs(llm, prompts, args.output_len, None, args.num_iters)
        progress(begin, f"engine without LoRA timed: {statistics.median(base[0]):.3f} s")
        llm.shutdown()
        llm = build_llm(args, max_seq_len=max_seq_len,
                        lora_config=LoraConfig(max_loras=args.batch_size, max_cpu_loras=args.batch_size + 1,
                                               max_lora_rank=args.rank))
        progress(begin, "engine with LoRA started")
        with_lora = timed_runs(llm, prompts, args.output_len, adapters[: args.batch_size], args.num_iters)
        progress(begin, f"with {args.batch_size} adapters timed: {statistics.median(with_lora[0]):.3f} s")
        same_engine_base = timed_runs(llm, prompts, args.output_len, None, args.num_iters)
        # A new adapter: read from disk and copied into a slot (the LRU one), then one token.
        from raylm import SamplingParams, TokensPrompt

        one = [TokensPrompt(prompt_token_ids=prompts[0])]
        params = SamplingParams(max_tokens=1, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(one, params, use_tqdm=False, lora_request=adapters[0])
        resident = time.perf_counter() - start
        start = time.perf_counter()
        llm.generate(one, params, use_tqdm=False, lora_request=adapters[-1])
        fresh = time.perf_counter() - start
        llm.shutdown()
    tokens = args.output_len
    for name, (times, prefills) in (("no_lora_engine", base), ("lora_engine_no_adapter", same_engine_base),
                                    ("lora_engine_adapters", with_lora)):
        median, prefill = statistics.median(times), statistics.median(prefills)
        result[name] = {"latency_s": times, "median_latency_s": median, "ms_per_token": 1000 * median / tokens,
                        "prefill_s": prefills, "median_prefill_s": prefill,
                        "decode_ms_per_token": 1000 * (median - prefill) / max(1, tokens - 1)}
    result["slowdown"] = result["lora_engine_adapters"]["median_latency_s"] / result["no_lora_engine"][
        "median_latency_s"]
    result["decode_slowdown"] = result["lora_engine_adapters"]["decode_ms_per_token"] / result["no_lora_engine"][
        "decode_ms_per_token"]
    result["adapter_load_s"] = fresh - resident
    name = f"lora-{Path(args.model or 'smollm2').name}-b{args.batch_size}-r{args.rank}-{llm.info.device}" \
           f"{run_suffix(args)}"
    print(f"batch {args.batch_size}, {args.batch_size} adapters of rank {args.rank}, {args.input_len} in / "
          f"{args.output_len} out on {llm.info.device}")
    print(f"{'':<26}{'latency':>12}{'per token':>15}{'prefill':>12}{'decode':>18}")
    for key in ("no_lora_engine", "lora_engine_no_adapter", "lora_engine_adapters"):
        entry = result[key]
        print(f"{key:<26}{entry['median_latency_s']:>10.3f} s{entry['ms_per_token']:>10.2f} ms/t"
              f"{1000 * entry['median_prefill_s']:>9.1f} ms{entry['decode_ms_per_token']:>10.2f} ms/token")
    print(f"with adapters / without: {result['slowdown']:.3f}x, decode alone {result['decode_slowdown']:.3f}x; a new "
          f"adapter loads in {1000 * result['adapter_load_s']:.1f} ms")
    print(f"wrote {write_result(name, args, result)}")


if __name__ == "__main__":
    main()
