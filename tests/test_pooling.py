"""The pooling of an encode_only engine: read from the model's sentence-transformers config, overridden field by
field by pooling_config, defaulted by the kind of model; Matryoshka sizes and their errors."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from raylm import PoolingConfig
from raylm.pooling import PoolingSpec, resolve_pooling

HF_CONFIG = SimpleNamespace(hidden_size=8)


def _sentence_transformers_dir(path, pooling: dict, normalize: bool = True, extra_module: str | None = None):
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    if extra_module:
        modules.append({"idx": 3, "name": "3", "path": "3", "type": extra_module})
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 8, **pooling}))
    (path / "modules.json").write_text(json.dumps(modules))
    return path


def test_minilm_pools_the_mean_normalized(minilm_dir):
    from transformers import AutoConfig

    spec = resolve_pooling(minilm_dir, AutoConfig.from_pretrained(minilm_dir), None, encoder_only=True)
    assert spec == PoolingSpec("mean", True, 384, None)


@pytest.mark.parametrize(("mode", "pooling_type"), [("pooling_mode_cls_token", "cls"),
                                                    ("pooling_mode_lasttoken", "last"),
                                                    ("pooling_mode_mean_tokens", "mean")])
def test_the_pooling_module_decides_the_type_and_normalize_its_presence(tmp_path, mode, pooling_type):
    directory = _sentence_transformers_dir(tmp_path, {mode: True}, normalize=False)
    assert resolve_pooling(directory, HF_CONFIG, None, encoder_only=True) == PoolingSpec(pooling_type, False, 8)


def test_pooling_config_overrides_the_model_field_by_field(tmp_path):
    directory = _sentence_transformers_dir(tmp_path, {"pooling_mode_cls_token": True})
    spec = resolve_pooling(directory, HF_CONFIG, PoolingConfig(pooling_type="last"), encoder_only=True)
    assert spec == PoolingSpec("last", True, 8)


def test_without_a_sentence_transformers_config_encoders_average_and_decoders_take_the_last_token(tmp_path):
    assert resolve_pooling(tmp_path, HF_CONFIG, None, encoder_only=True) == PoolingSpec("mean", True, 8)
    assert resolve_pooling(tmp_path, HF_CONFIG, None, encoder_only=False) == PoolingSpec("last", True, 8)


@pytest.mark.parametrize(("pooling", "extra", "match"), [
    ({"pooling_mode_max_tokens": True}, None, "pooling_mode_max_tokens"),
    ({"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True}, None, "supported: one of"),
    ({"pooling_mode_mean_tokens": True}, "sentence_transformers.models.Dense", "Dense'.*is not supported"),
])
def test_sentence_transformers_modules_raylm_cannot_apply_are_errors(tmp_path, pooling, extra, match):
    directory = _sentence_transformers_dir(tmp_path, pooling, extra_module=extra)
    with pytest.raises(ValueError, match=match):
        resolve_pooling(directory, HF_CONFIG, None, encoder_only=True)


def test_matryoshka_sizes_come_from_the_config_or_pooling_config(tmp_path):
    listed = SimpleNamespace(hidden_size=8, matryoshka_dimensions=[2, 4, 8])
    assert resolve_pooling(tmp_path, listed, None, True).dimensions == (2, 4, 8)
    any_size = SimpleNamespace(hidden_size=8, is_matryoshka=True)
    assert resolve_pooling(tmp_path, any_size, None, True).dimensions == tuple(range(1, 9))
    assert resolve_pooling(tmp_path, HF_CONFIG, PoolingConfig(matryoshka_dimensions=[4]), True).dimensions == (4,)
    with pytest.raises(ValueError, match=r"matryoshka_dimensions must be <= the hidden size \(8\), got \[16\]"):
        resolve_pooling(tmp_path, HF_CONFIG, PoolingConfig(matryoshka_dimensions=[4, 16]), True)
    with pytest.raises(ValueError, match="matryoshka_dimensions must be positive"):
        PoolingConfig(matryoshka_dimensions=[0])


def test_dimensions_errors_name_the_field_and_the_allowed_sizes():
    with pytest.raises(ValueError, match="dimensions is not supported by this model"):
        PoolingSpec("mean", True, 8).check_dimensions(4)
    with pytest.raises(ValueError, match=r"dimensions must be one of \[2, 4\], got 3"):
        PoolingSpec("mean", True, 8, (2, 4)).check_dimensions(3)
    with pytest.raises(ValueError, match=r"dimensions must be in \[1, 8\], got 9"):
        PoolingSpec("mean", True, 8, tuple(range(1, 9))).check_dimensions(9)
    PoolingSpec("mean", True, 8, (2, 4)).check_dimensions(4)
