"""How an encode_only engine pools a prompt's hidden states into one embedding: the PoolingSpec, resolved once at
start-up from LlmArgs.pooling_config, the model's sentence-transformers config (modules.json and its Pooling and
Normalize modules) and its HF config (Matryoshka sizes).

Nothing here imports torch: the HTTP ingress, which never computes, reads the spec from EngineInfo.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raylm.config import PoolingConfig

POOLING_TYPES = ("mean", "cls", "last")

# sentence-transformers' Pooling config keys, and the pooling each selects.
_ST_MODES = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_lasttoken": "last",
    "pooling_mode_max_tokens": None,
    "pooling_mode_mean_sqrt_len_tokens": None,
    "pooling_mode_weightedmean_tokens": None,
}
_ST_MODULE = "sentence_transformers.models."
# Modules that leave the pooled embedding as it is (the transformer itself runs in the engine).
_ST_PASSIVE = {"Transformer", "Pooling", "Normalize"}


@dataclass(frozen=True)
class PoolingSpec:
    """The pooling of an encode_only engine: which hidden states make the embedding, whether it is scaled to unit
    norm, and the sizes it may be truncated to (Matryoshka; None: not truncatable)."""

    pooling_type: str  # one of POOLING_TYPES
    normalize: bool
    hidden_size: int
    dimensions: tuple[int, ...] | None = None

    def check_dimensions(self, dimensions: int) -> None:
        """Raises ValueError unless embeddings of this model may be truncated to `dimensions` values."""
        if self.dimensions is None:
            raise ValueError("dimensions is not supported by this model: its embeddings are not Matryoshka "
                             "representations (its config names no matryoshka_dimensions; "
                             "pooling_config.matryoshka_dimensions can allow sizes)")
        if dimensions in self.dimensions:
            return
        if self.dimensions == tuple(range(1, len(self.dimensions) + 1)):
            raise ValueError(f"dimensions must be in [1, {len(self.dimensions)}], got {dimensions}")
        raise ValueError(f"dimensions must be one of {list(self.dimensions)}, got {dimensions}")


def _read_json(path: Path) -> Any:
    with path.open(encoding="utf-8") as handle:
        return json.load(handle)


def sentence_transformers_pooling(model_dir: Path) -> dict[str, Any]:
    """The pooling_type and normalize a sentence-transformers model directory states (modules.json), as
    PoolingConfig fields; {} for a directory without one. Raises ValueError for modules raylm cannot apply."""
    modules_path = model_dir / "modules.json"
    if not modules_path.is_file():
        return {}
    found: dict[str, Any] = {"normalize": False}
    for module in _read_json(modules_path):
        kind = str(module.get("type", "")).removeprefix(_ST_MODULE)
        if kind not in _ST_PASSIVE:
            raise ValueError(f"the model's sentence-transformers module {module.get('type')!r} (modules.json) is not "
                             f"supported; supported: {', '.join(sorted(_ST_PASSIVE))}")
        if kind == "Normalize":
            found["normalize"] = True
        elif kind == "Pooling":
            config_path = model_dir / module.get("path", "") / "config.json"
            config = _read_json(config_path) if config_path.is_file() else {"pooling_mode_mean_tokens": True}
            modes = [key for key in _ST_MODES if config.get(key)]
            if len(modes) != 1 or _ST_MODES[modes[0]] is None:
                raise ValueError(f"the model's sentence-transformers pooling ({config_path}) uses "
                                 f"{modes or 'no mode'}; supported: one of pooling_mode_mean_tokens, "
                                 "pooling_mode_cls_token, pooling_mode_lasttoken")
            found["pooling_type"] = _ST_MODES[modes[0]]
    return found


def sentence_transformers_max_length(model_dir: Path) -> int | None:
    """The longest input a sentence-transformers model was set up for (sentence_bert_config.json), if it says."""
    path = model_dir / "sentence_bert_config.json"
    if not path.is_file():
        return None
    length = _read_json(path).get("max_seq_length")
    return int(length) if length else None


def _matryoshka_dimensions(hf_config: Any, hidden_size: int) -> tuple[int, ...] | None:
    sizes = getattr(hf_config, "matryoshka_dimensions", None)
    if sizes:
        return tuple(int(size) for size in sizes)
    if getattr(hf_config, "is_matryoshka", False):
        return tuple(range(1, hidden_size + 1))
    return None


def resolve_pooling(model_dir: Path, hf_config: Any, override: PoolingConfig | None,
                    encoder_only: bool) -> PoolingSpec:
    """The pooling of an encode_only engine: each field of `override` that is set, else the model's
    sentence-transformers config, else mean pooling for encoders and the last token for decoders, normalized."""
    hidden_size = int(hf_config.hidden_size)
    from_model = sentence_transformers_pooling(model_dir)
    override = override or PoolingConfig()
    pooling_type = override.pooling_type or from_model.get("pooling_type") or ("mean" if encoder_only else "last")
    normalize = override.normalize if override.normalize is not None else from_model.get("normalize", True)
    if override.matryoshka_dimensions is not None:
        too_large = [size for size in override.matryoshka_dimensions if size > hidden_size]
        if too_large:
            raise ValueError(f"pooling_config.matryoshka_dimensions must be <= the hidden size ({hidden_size}), "
                             f"got {too_large}")
        dimensions = tuple(override.matryoshka_dimensions)
    else:
        dimensions = _matryoshka_dimensions(hf_config, hidden_size)
    return PoolingSpec(pooling_type, bool(normalize), hidden_size, dimensions)
