"""Shared pieces of the benchmarks: arguments, random prompts, the HF transformers peer, result files."""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import platform
import random
import signal
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"

# With RAYLM_STACKS_DIR set (benchmarks/h200.sh's `watched`), `kill -USR1` makes a benchmark write every thread's
# stack to a file there: where an engine running in this process (one GPU) waits, as its Ray workers print theirs.
if os.environ.get("RAYLM_STACKS_DIR"):
    os.makedirs(os.environ["RAYLM_STACKS_DIR"], exist_ok=True)
    _STACKS = open(os.path.join(os.environ["RAYLM_STACKS_DIR"], f"benchmark-{os.getpid()}.txt"), "w")
    faulthandler.register(signal.SIGUSR1, file=_STACKS, all_threads=True)


def add_model_args(parser: argparse.ArgumentParser, peer: bool = True) -> None:
    parser.add_argument("--model", default=None, help="HF dir, config-only dir (with --load_format dummy), "
                                                      ".gguf, hub id; default: embedded SmolLM2-135M-Instruct")
    parser.add_argument("--load_format", default="auto", choices=["auto", "dummy"])
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--max_batch_size", type=int, default=256)
    parser.add_argument("--max_num_tokens", type=int, default=8192)
    parser.add_argument("--kv_cache_max_tokens", type=int, default=None)
    parser.add_argument("--kv_cache_free_gpu_memory_fraction", type=float, default=0.9)
    if peer:
        parser.add_argument("--peer", choices=["none", "hf"], default="none",
                            help="also run HF transformers on the same prompts and print the ratio")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (GPUs per pipeline stage)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    parser.add_argument("--attention_backend", default="auto", choices=["auto", "torch", "triton", "flashinfer"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", dest="settings", action="append", default=[], metavar="PATH=VALUE",
                        help="any LLM setting, as `raylm serve --set` takes it (kernel_config.pdl=off, "
                             "cuda_graph_config.capture_logits=false, ...); named in the result file's name")
    parser.add_argument("--output_json", default=None, help="result file (default: benchmarks/results/<name>.json)")


def random_prompts(num: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Random token-id prompts, avoiding the first 1000 ids (special tokens live there in most vocabularies)."""
    rng = random.Random(seed)
    low = min(1000, vocab_size // 2)
    return [[rng.randrange(low, vocab_size) for _ in range(length)] for _ in range(num)]


def settings(args: argparse.Namespace) -> list[tuple[str, object]]:
    """The run's --set assignments as (dotted path, value), checked as `raylm serve --set` checks them."""
    from raylm.serving.config_sources import parse_assignment

    return [parse_assignment(text) for text in getattr(args, "settings", [])]


def llm_options(args: argparse.Namespace, max_seq_len: int) -> dict:
    """The LLM keyword arguments of the benchmark's model arguments, with its --set assignments applied."""
    options = dict(
        model=args.model, load_format=args.load_format, dtype=args.dtype, device=args.device,
        tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp,
        max_batch_size=args.max_batch_size, max_num_tokens=args.max_num_tokens, max_seq_len=max_seq_len,
        skip_tokenizer_init=args.load_format == "dummy", seed=args.seed, attention_backend=args.attention_backend,
        kv_cache_config={"max_tokens": args.kv_cache_max_tokens, "enable_block_reuse": False,
                         "free_gpu_memory_fraction": args.kv_cache_free_gpu_memory_fraction},
    )
    for path, value in settings(args):
        *parents, leaf = path.split(".")
        tree = options
        for name in parents:
            tree = tree.setdefault(name, {})
        tree[leaf] = value
    return options


def build_llm(args: argparse.Namespace, max_seq_len: int, executor: str = "auto", **options):
    """An LLM for the benchmark's model arguments; options go to LLM as they are (worker_extension_cls...)."""
    from raylm import LLM

    return LLM(executor=executor, **options, **llm_options(args, max_seq_len))


def parallel_suffix(args: argparse.Namespace) -> str:
    """'-tp2', '-pp2', '-tp2-pp2' for multi-GPU runs (part of result names), '' for one device."""
    return "".join(f"-{name}{size}" for name, size in (("tp", args.tp), ("pp", args.pp)) if size > 1)


def settings_suffix(args: argparse.Namespace) -> str:
    """One part per --set assignment, in order: '-<field>' for true, '-no<field>' for false, '-<field>-<value>'
    otherwise (the field: the path's last name), so that a run with a setting changed never overwrites the default
    run's result."""
    suffix = ""
    for path, value in settings(args):
        field = path.rsplit(".", 1)[-1]
        if isinstance(value, bool):
            suffix += f"-{field}" if value else f"-no{field}"
        else:
            suffix += f"-{field}-{value}"
    return suffix


def run_suffix(args: argparse.Namespace) -> str:
    """parallel_suffix, then '-<backend>' when an attention backend was chosen, then settings_suffix (part of
    result names)."""
    backend = "" if args.attention_backend == "auto" else f"-{args.attention_backend}"
    return parallel_suffix(args) + backend + settings_suffix(args)


def release_device_memory(device: str) -> None:
    """Returns what a shut-down engine held to the device, so that a peer run after it has the memory."""
    import gc

    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        print(f"device memory still allocated after the engine's shutdown: {torch.cuda.memory_allocated() / 2**30:.2f} "
              "GiB")


def hf_peer(args: argparse.Namespace, info):
    """The same model in HF transformers, on the same device and dtype (random weights for dummy runs)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from raylm.models.source import resolve_model

    source = resolve_model(args.model)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[info.dtype]
    if args.load_format == "dummy":
        config = AutoConfig.from_pretrained(source.config_dir)
        with torch.device(info.device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(source.config_dir, dtype=dtype).to(info.device)
    model.eval()
    return model


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def graph_call_us(body, calls: int, replays: int = 5) -> float:
    """Microseconds per call of `body()`, which makes `calls` calls, captured once in a CUDA graph and replayed
    `replays` times (warm-up, such as kernel tuning, is the caller's, before this)."""
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1000 * start.elapsed_time(end) / (replays * calls)


def machine() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads"


def write_result(name: str, args: argparse.Namespace, result: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = Path(args.output_json) if args.output_json else RESULTS / f"{name}.json"
    record = {"name": name, "machine": machine(), "torch": torch.__version__,
              "time": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args), **result}
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path
