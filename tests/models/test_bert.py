"""BertModel: hidden states equal HF transformers' BertModel on all-MiniLM-L6-v2 for a packed batch of prompts of
different lengths; what it cannot run is a clear error."""

from __future__ import annotations

import pytest
import torch

from raylm.kernels.packed_attention import PackedAttention
from raylm.models.bert import BertModel, encoder_arch_from_hf
from raylm.models.loader import load_hf_config, load_model
from raylm.models.source import resolve_model
from tests.conftest import SENTENCES


@pytest.fixture(scope="module")
def minilm(minilm_dir):
    source = resolve_model(str(minilm_dir))
    return load_model(source, load_hf_config(source), torch.float32, torch.device("cpu"), 256).model


@pytest.mark.parametrize("pad_inputs_below", [0.0, 1.0])  # padding in each layer's attention, or once at the input
def test_packed_hidden_states_equal_hf_per_prompt(minilm, minilm_dir, pad_inputs_below):
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(minilm_dir)
    prompts = [tokenizer.encode(text) for text in SENTENCES]
    lengths = [len(prompt) for prompt in prompts]
    assert len(set(lengths)) > 3
    input_ids = torch.tensor([token for prompt in prompts for token in prompt])
    positions = torch.cat([torch.arange(length) for length in lengths])
    with torch.no_grad():
        meta = PackedAttention.build(lengths, causal=False, device=torch.device("cpu"),
                                     pad_inputs_below=pad_inputs_below)
        assert meta.rows_padded == (pad_inputs_below == 1.0)
        hidden = minilm(input_ids, positions, meta)
        reference = AutoModel.from_pretrained(minilm_dir, dtype=torch.float32).eval()
        start = 0
        for prompt in prompts:
            expected = reference(torch.tensor([prompt])).last_hidden_state[0]
            torch.testing.assert_close(hidden[start:start + len(prompt)], expected, atol=1e-5, rtol=0)
            start += len(prompt)


def test_every_checkpoint_tensor_but_the_pooler_fills_a_parameter(minilm, minilm_dir):
    from safetensors import safe_open

    with safe_open(str(minilm_dir / "model.safetensors"), framework="pt") as handle:
        names = [name for name in handle.keys() if BertModel._local_name(name) is not None]
    assert not any(name.startswith("pooler.") for name in names)
    assert {BertModel._local_name(name)[0] for name in names} == {name for name, _ in minilm.named_parameters()}


def test_positions_beyond_the_model_and_relative_positions_are_errors(minilm_dir):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(minilm_dir)
    with pytest.raises(ValueError, match=r"max_seq_len must be <= 512 .*max_position_embeddings.*got 1024"):
        BertModel(encoder_arch_from_hf(config, "BertModel"), max_positions=1024)
    config.position_embedding_type = "relative_key"
    with pytest.raises(ValueError, match="position_embedding_type 'relative_key' is not supported"):
        encoder_arch_from_hf(config, "BertModel")


def test_a_tensor_of_the_wrong_shape_names_itself(minilm):
    with pytest.raises(ValueError, match=r"'encoder.layer.0.attention.self.key.weight' has shape \(3, 3\)"):
        minilm.load_weights([("encoder.layer.0.attention.self.key.weight", torch.zeros(3, 3))])
