"""The `raylm` command line."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

_LOG_LEVELS = ["error", "warning", "info", "debug"]


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    engine = parser.add_argument_group("engine")
    engine.add_argument("--model", default=None,
                        help="HF directory, .gguf file, hub id or alias (default: embedded SmolLM2-135M-Instruct)")
    engine.add_argument("--tokenizer", default=None, help="tokenizer directory or hub id (None: the model's)")
    engine.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="weight and activation dtype (auto: float32 on CPUs, the checkpoint's half type on GPUs)")
    engine.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="where the model runs")
    engine.add_argument("--max_batch_size", "--max-batch-size", type=int, default=256,
                        help="most requests the engine schedules at once")
    engine.add_argument("--max_num_tokens", "--max-num-tokens", type=int, default=8192,
                        help="most batched tokens in one engine iteration")
    engine.add_argument("--max_seq_len", "--max-seq-len", type=int, default=None,
                        help="longest request, prompt plus output (None: the model's context length)")
    engine.add_argument("--kv_cache_max_tokens", "--kv-cache-max-tokens", type=int, default=None,
                        help="KV cache capacity in tokens (the CPU capacity; a cap on GPU)")
    engine.add_argument("--kv_cache_free_gpu_memory_fraction", type=float, default=0.9,
                        help="fraction of the free GPU memory the KV cache takes after the model is loaded")
    engine.add_argument("--tokens_per_block", type=int, default=32, help="tokens per KV cache block")
    engine.add_argument("--trust_remote_code", action="store_true",
                        help="let HF transformers run the model's own code")
    engine.add_argument("--log_level", default="warning", choices=_LOG_LEVELS, help="log level")


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    sampling = parser.add_argument_group("sampling")
    sampling.add_argument("--max_tokens", "--max-tokens", type=int, default=128, help="most tokens to generate")
    sampling.add_argument("--min_tokens", type=int, default=0, help="tokens to generate before EOS may end the output")
    sampling.add_argument("--temperature", type=float, default=None,
                          help="0 or None: greedy, unless top_k / top_p / min_p is set")
    sampling.add_argument("--top_k", "--top-k", type=int, default=None, help="sample among the k likeliest tokens")
    sampling.add_argument("--top_p", "--top-p", type=float, default=None,
                          help="sample among the likeliest tokens whose probabilities sum to p")
    sampling.add_argument("--min_p", "--min-p", type=float, default=None,
                          help="drop tokens less likely than min_p times the likeliest")
    sampling.add_argument("--seed", type=int, default=None, help="seed of a request's sampling")
    sampling.add_argument("--repetition_penalty", type=float, default=1.0, help="1.0: none")
    sampling.add_argument("--presence_penalty", type=float, default=0.0, help="0.0: none")
    sampling.add_argument("--frequency_penalty", type=float, default=0.0, help="0.0: none")
    sampling.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    sampling.add_argument("--ignore_eos", action="store_true", help="generate past EOS up to max_tokens")
    sampling.add_argument("--n", type=int, default=1, help="completions per prompt")
    sampling.add_argument("--beam_width", type=int, default=None, help="beam search with this many beams")


def _read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompts)
    if args.prompts_file:
        try:
            with open(args.prompts_file, encoding="utf-8") as handle:
                prompts.extend(line.rstrip("\n") for line in handle if line.strip())
        except OSError as exc:
            raise SystemExit(f"raylm generate: error: cannot read --prompts_file {args.prompts_file}: "
                             f"{exc.strerror}") from None
    if not prompts and not sys.stdin.isatty():
        prompts.extend(line.rstrip("\n") for line in sys.stdin if line.strip())
    if not prompts:
        raise SystemExit("raylm generate: give prompts as arguments, with --prompts_file, or on stdin")
    return prompts


def _sampling_params(args: argparse.Namespace):
    from raylm import SamplingParams

    beam = args.beam_width is not None
    return SamplingParams(
        max_tokens=args.max_tokens, min_tokens=args.min_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, min_p=args.min_p, seed=args.seed, repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty, stop=args.stop,
        ignore_eos=args.ignore_eos, n=args.n, best_of=args.beam_width if beam else None, use_beam_search=beam,
    )


def _build_llm(args: argparse.Namespace):
    from raylm import LLM, KvCacheConfig

    return LLM(
        model=args.model, tokenizer=args.tokenizer, dtype=args.dtype, device=args.device,
        max_batch_size=args.max_batch_size, max_num_tokens=args.max_num_tokens, max_seq_len=args.max_seq_len,
        trust_remote_code=args.trust_remote_code,
        kv_cache_config=KvCacheConfig(max_tokens=args.kv_cache_max_tokens, tokens_per_block=args.tokens_per_block,
                                      free_gpu_memory_fraction=args.kv_cache_free_gpu_memory_fraction),
    )


def generate(args: argparse.Namespace) -> int:
    """Generates for each prompt; all prompts run as one batch, printed in order as their tokens arrive."""
    from raylm.inputs import apply_chat_template

    user_prompts = _read_prompts(args)
    params = _sampling_params(args)
    with _build_llm(args) as llm:
        prompts = user_prompts
        if args.chat:
            system = [{"role": "system", "content": args.system}] if args.system else []
            prompts = [apply_chat_template(llm.tokenizer, system + [{"role": "user", "content": p}])
                       for p in user_prompts]
            params.add_special_tokens = False
        results = [llm.generate_async(prompt, params, streaming=not args.json) for prompt in prompts]
        for user_prompt, result in zip(user_prompts, results):
            if args.json:
                output = result.result()
                record = {"prompt": user_prompt, "outputs": [
                    {"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason}
                    for c in output.outputs]}
                print(json.dumps(record), flush=True)
                continue
            if len(user_prompts) > 1 or args.chat:
                print(f">>> {user_prompt}", flush=True)
            else:
                sys.stdout.write(user_prompt)
            last = None
            for chunk in result:
                last = chunk
                if params.n == 1 and not params.use_beam_search:
                    sys.stdout.write(chunk.outputs[0].text_diff)
                    sys.stdout.flush()
            if params.n > 1 or params.use_beam_search:
                for completion in last.outputs:
                    print(f"\n[{completion.index}] {completion.text}")
            print(flush=True)
    return 0


# The dedicated flags of `raylm serve`: (flags, the config path each sets, argparse options, help).
_SERVE_FLAGS: list[tuple[tuple[str, ...], str, dict, str]] = [
    (("--host",), "host", {}, "address the HTTP server binds (default localhost)"),
    (("--port",), "port", {"type": int}, "port of the HTTP server (default 8000)"),
    (("--tp_size", "--tensor_parallel_size"), "tensor_parallel_size", {"type": int}, "tensor parallelism size"),
    (("--pp_size", "--pipeline_parallel_size"), "pipeline_parallel_size", {"type": int}, "pipeline parallelism size"),
    (("--ep_size", "--moe_expert_parallel_size"), "moe_expert_parallel_size", {"type": int},
     "expert parallelism size (MoE models; at most tp_size)"),
    (("--max_batch_size",), "max_batch_size", {"type": int}, "most requests the engine schedules at once"),
    (("--max_num_tokens",), "max_num_tokens", {"type": int}, "most batched tokens in one engine iteration"),
    (("--max_seq_len",), "max_seq_len", {"type": int},
     "longest request, prompt plus output (default: the model's context length)"),
    (("--kv_cache_free_gpu_memory_fraction", "--free_gpu_memory_fraction"), "kv_cache_config.free_gpu_memory_fraction",
     {"type": float}, "fraction of the free GPU memory the KV cache takes after the model is loaded"),
    (("--tokenizer",), "tokenizer", {}, "tokenizer directory or hub id (default: the model's)"),
    (("--revision", "--hf_revision"), "revision", {}, "revision of a Hugging Face hub model"),
    (("--trust_remote_code",), "trust_remote_code", {"action": "store_true", "default": None},
     "let HF transformers run the model's own code"),
    (("--served_model_name",), "served_model_name", {}, "the model name of the API (default: MODEL)"),
    (("--chat_template",), "chat_template", {}, "a Jinja chat template, or a file holding one"),
    (("--tool_call_parser",), "tool_call_parser", {"choices": ("hermes", "llama3_json")},
     "read the model's tool calls out of its chat answers: hermes (<tool_call> JSON) or llama3_json"),
    (("--reasoning_parser",), "reasoning_parser", {"choices": ("deepseek_r1", "qwen3")},
     "return a reasoning model's <think> part as reasoning_content: deepseek_r1 or qwen3"),
    (("--num_replicas",), "num_replicas", {"type": int}, "engine replicas, each with its HTTP front end (data "
                                                          "parallelism; default 1)"),
    (("--lora_modules",), "lora_modules", {"nargs": "+", "metavar": "NAME=PATH"},
     "serve PEFT LoRA adapters as models of their own, each NAME=PATH (turns lora_config on)"),
    (("--enable_lora_loading",), "enable_lora_loading", {"action": "store_true", "default": None},
     "serve /v1/load_lora_adapter and /v1/unload_lora_adapter (behind --api_key when set)"),
    (("--api_key",), "api_key", {}, "require 'Authorization: Bearer KEY' on every route but /health "
                                    "(default: $RAYLM_API_KEY)"),
    (("--enable_rl_endpoints",), "enable_rl_endpoints", {"action": "store_true", "default": None},
     "serve /pause, /resume_generation, /update_weights, /weight_version, /device_ids, /release, /resume and "
     "/memory_status for an RL trainer (behind --api_key when set)"),
    (("--enable_profiling_endpoints",), "enable_profiling_endpoints", {"action": "store_true", "default": None},
     "serve /start_profile and /stop_profile (behind --api_key when set)"),
    (("--profile_dir",), "profile_dir", {}, "where /start_profile writes traces; requests may name only a "
                                            "sub-folder (default: $RAYLM_TORCH_PROFILER_DIR)"),
    (("--log_level",), "log_level", {"choices": _LOG_LEVELS}, "log level (default warning)"),
]


def _add_serve_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "serve", help="serve MODEL over an OpenAI-compatible HTTP API with Ray Serve",
        description="Serve MODEL over an OpenAI-compatible HTTP API with Ray Serve, in the foreground until Ctrl-C. "
                    "Settings come from, lowest precedence first: the defaults, --config, the flags below, --set. "
                    "A --config file may list several models under `models` instead of MODEL; the engine flags "
                    "and --set then give every model's defaults, which a model's own entry overrides. "
                    "It starts a local Ray cluster unless RAY_ADDRESS names one.",
    )
    parser.add_argument("model", nargs="?", default=None,
                        help="HF directory, .gguf file, hub id or alias (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--config", "--extra_llm_api_options", dest="config_file", default=None, metavar="YAML",
                        help="a YAML file of config fields (see --print_schema)")
    parser.add_argument("--set", dest="assignments", action="append", default=[], metavar="PATH=VALUE",
                        help="set one config field, as a dotted path and a YAML value; repeatable, applied last "
                             "(e.g. --set kv_cache_config.max_tokens=4096)")
    parser.add_argument("--print_schema", "--print-schema", action="store_true",
                        help="print the JSON schema of the --config file and exit")
    flags = parser.add_argument_group("server and engine")
    for names, path, options, help_text in _SERVE_FLAGS:
        if options.get("action") != "store_true":
            options = {"metavar": path.rsplit(".", 1)[-1].upper(), **options}
        flags.add_argument(*names, dest=path, help=help_text, **{"default": None, **options})
    parser.set_defaults(handler=serve, command_parser=parser)


def serve_flag_values(args: argparse.Namespace) -> dict:
    """The config paths the command line sets, None for those it leaves to --config and the defaults."""
    values = {"model": args.model}
    values.update({path: getattr(args, path) for _, path, _, _ in _SERVE_FLAGS})
    return values


def _wait_for_interrupt() -> None:
    """Blocks until Ctrl-C (SIGINT) or SIGTERM, whatever handlers the process inherited."""
    stop = threading.Event()
    handled = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in handled}
    try:
        while not stop.wait(0.5):
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextmanager
def _needs_the_serve_extra() -> Iterator[None]:
    """Imports of the server's modules: a missing dependency says, in one line, how to install them."""
    try:
        yield
    except ModuleNotFoundError as exc:
        raise SystemExit(f"raylm serve: error: the server needs the 'serve' extra, which lacks {exc.name}: "
                         f"pip install 'raylm[serve]' (in a checkout: pip install -e \".[serve]\")") from None


def serve(args: argparse.Namespace) -> int:
    """Deploys the OpenAI-compatible server on Ray Serve and keeps it up until interrupted."""
    with _needs_the_serve_extra():
        from raylm.serving.config import serve_args_schema
        from raylm.serving.config_sources import layer_serve_args

    if args.print_schema:
        print(json.dumps(serve_args_schema(), indent=2))
        return 0
    config = layer_serve_args(args.config_file, serve_flag_values(args), args.assignments)
    logging.getLogger().setLevel(config.log_level.upper())
    from raylm.models.source import resolve_model

    models = config.served_models()
    for model in models:  # a bad MODEL fails here, before any cluster starts
        resolve_model(model.model, model.revision)
    with _needs_the_serve_extra():
        from raylm.serving.ray_serve import start_server

    try:
        server = start_server(config, progress=lambda stage: print(f"raylm serve: {stage}...", flush=True))
    except KeyboardInterrupt:
        return 130
    except RuntimeError as exc:
        print(f"raylm serve: error: {exc}", file=sys.stderr)
        return 1
    names = ", ".join(model.model_name for model in models)
    print(f"raylm serve: ready: {names} {'is' if len(models) == 1 else 'are'} served at {server.url}/v1 "
          "(Ctrl-C to stop)", flush=True)
    try:
        _wait_for_interrupt()
    finally:
        print("raylm serve: shutting down", flush=True)
        server.stop()
    return 0


def _add_batch_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "batch", help="answer a file of requests or prompts on a Ray cluster (Ray Data)",
        description="Answer every row of INPUT (JSONL or Parquet: OpenAI Batch requests, or rows with a `prompt` or "
                    "`messages` column) with engine replicas on the Ray cluster (RAY_ADDRESS, as `ray job submit` "
                    "sets it, or a new local one), writing JSONL answers under OUTPUT. Settings come from, lowest "
                    "precedence first: the defaults, --config, the flags below, --set (see raylm.batch.BatchArgs).",
    )
    parser.add_argument("-i", "--input", required=True, help="a file, a directory or a URI of JSONL / Parquet rows")
    parser.add_argument("-o", "--output", required=True, help="the directory (or URI) the answers go to")
    parser.add_argument("--model", default=None, help="HF directory, .gguf file, hub id or alias "
                                                       "(default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--num_replicas", type=int, default=None, help="engine replicas (default 1)")
    parser.add_argument("--max_replicas", type=int, default=None, help="scale up to this many replicas")
    parser.add_argument("--tensor_parallel_size", "--tp", type=int, default=None, help="GPUs per replica's stage")
    parser.add_argument("--max_tokens", type=int, default=None, help="table rows' max_tokens unless they set it")
    parser.add_argument("--temperature", type=float, default=None, help="table rows' temperature unless they set "
                                                                        "it (OpenAI's default 1.0 when unset)")
    parser.add_argument("--resume", action="store_true", help="skip rows already answered in OUTPUT")
    parser.add_argument("--config", dest="config_file", default=None, metavar="YAML",
                        help="a YAML file of BatchArgs fields (engine settings included)")
    parser.add_argument("--set", dest="assignments", action="append", default=[], metavar="PATH=VALUE",
                        help="one BatchArgs field as a dotted path and a YAML value, applied last "
                             "(e.g. --set kv_cache_config.max_tokens=4096, --set sampling.top_p=0.9)")
    parser.add_argument("--log_level", default="warning", choices=_LOG_LEVELS)
    parser.set_defaults(handler=batch)


def batch(args: argparse.Namespace) -> int:
    """Runs a batch job and prints its summary."""
    import yaml

    from raylm.batch import BatchArgs, run_batch

    tree: dict = {}
    if args.config_file:
        with open(args.config_file, encoding="utf-8") as handle:
            tree = yaml.safe_load(handle) or {}
    flags = {"input": args.input, "output": args.output, "model": args.model, "num_replicas": args.num_replicas,
             "max_replicas": args.max_replicas, "tensor_parallel_size": args.tensor_parallel_size,
             "resume": args.resume or None, "sampling.max_tokens": args.max_tokens,
             "sampling.temperature": args.temperature}
    assignments = [text.partition("=") for text in args.assignments]
    for path, value in [*flags.items(), *((path.strip(), yaml.safe_load(raw)) for path, _, raw in assignments)]:
        if value is None:
            continue
        *parents, leaf = path.split(".")
        node = tree
        for name in parents:
            node = node.setdefault(name, {})
        node[leaf] = value
    summary = run_batch(BatchArgs(**tree))
    print(f"raylm batch: {summary}", flush=True)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raylm", description="raylm: a Ray-native LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for prompts (arguments, a file, or stdin)",
                         description="Generate text for prompts (arguments, a file, or stdin); greedy unless "
                                     "sampling flags say otherwise.",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    gen.add_argument("prompts", nargs="*", default=[], help="prompts; read from --prompts_file or stdin when none")
    gen.add_argument("--prompts_file", "--prompts-file", default=None, help="a file with one prompt per line")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    gen.add_argument("--system", default=None, help="system message for --chat")
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt instead of streaming")
    _add_engine_args(gen)
    _add_sampling_args(gen)
    gen.set_defaults(handler=generate, command_parser=gen)
    _add_serve_parser(sub)
    _add_batch_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # with the usage of the subcommand they were given to, not the top level's
        args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    level = args.log_level or "warning"  # serve leaves it to its config layers
    logging.basicConfig(level=getattr(logging, level.upper()), format="%(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        return args.handler(args)
    except (ValueError, TypeError) as exc:
        print(f"raylm {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
