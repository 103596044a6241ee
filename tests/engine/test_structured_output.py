"""Structured output (raylm/engine/structured_output.py and the sampler's masks): what the real SmolLM2 writes
under a JSON schema, a regex or a choice always conforms, sampled at temperature 1.0 or greedy, and requests
without a grammar in the same batch decode exactly as they do alone."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from raylm import LLM, GuidedDecodingParams, KvCacheConfig, SamplingParams
from raylm.engine.structured_output import check_guided

_NAME = {"type": "string", "minLength": 1, "maxLength": 12}

# Each bounded (string lengths, array sizes) so that a conforming output fits in max_tokens.
SCHEMAS = [
    {"type": "object", "properties": {"name": _NAME}, "required": ["name"]},
    {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["age"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"price": {"type": "number"}}, "required": ["price"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"name": _NAME, "age": {"type": "integer"}}, "required": ["name", "age"],
     "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": _NAME, "minItems": 1, "maxItems": 3}},
     "required": ["tags"]},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {"x": {"type": "integer"},
                                                                               "y": {"type": "integer"}},
                                                "required": ["x", "y"], "additionalProperties": False}},
     "required": ["point"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"status": {"const": "done"}, "count": {"type": "integer"}},
     "required": ["status", "count"]},
    {"type": "object", "properties": {"city": _NAME, "country": _NAME, "population": {"type": "integer"}},
     "required": ["city", "country", "population"], "additionalProperties": False},
    {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no", "maybe"]},
                                      "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["answer", "confidence"]},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"id": {"type": "integer"}, "label": _NAME},
        "required": ["id", "label"], "additionalProperties": False}}}, "required": ["items"],
     "additionalProperties": False},
    {"type": "object", "properties": {"nickname": {"anyOf": [_NAME, {"type": "null"}]}}, "required": ["nickname"]},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
     "required": ["code"]},
    {"type": "object", "properties": {"level": {"type": "integer", "enum": [1, 2, 3]}, "ok": {"type": "boolean"}},
     "required": ["level", "ok"], "additionalProperties": False},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "name": _NAME, "roles": {"type": "array", "items": {"enum": ["admin", "user"]}, "maxItems": 2}},
        "required": ["name", "roles"], "additionalProperties": False}}, "required": ["user"],
     "additionalProperties": False},
    {"type": "string", "maxLength": 16},
    {"type": "integer", "minimum": 10, "maximum": 99},
    {"type": "object", "properties": {"matrix": {"type": "array", "maxItems": 2, "items": {
        "type": "array", "items": {"type": "integer"}, "maxItems": 2}}}, "required": ["matrix"],
     "additionalProperties": False},
    {"type": "object", "properties": {"title": _NAME, "year": {"type": "integer", "minimum": 1900,
                                                              "maximum": 2100},
                                      "genres": {"type": "array", "items": {"enum": ["drama", "comedy"]},
                                                 "uniqueItems": True, "maxItems": 2}},
     "required": ["title", "year", "genres"], "additionalProperties": False},
]

FREE_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    llm = LLM(model=str(smollm2_dir), executor="local", max_batch_size=64, max_seq_len=512)
    yield llm
    llm.shutdown()


def _json_params(schema: dict, **sampling) -> SamplingParams:
    return SamplingParams(max_tokens=160, guided_decoding=GuidedDecodingParams(json=schema), **sampling)


def _prompt(schema: dict) -> str:
    return f"Write one JSON value for this schema: {json.dumps(schema)}\nJSON:"


def test_every_schema_validates_sampled_and_greedy_batched_with_free_requests_that_stay_identical(smollm2):
    free = SamplingParams(max_tokens=24)
    alone = [o.outputs[0].token_ids for o in smollm2.generate(FREE_PROMPTS, free)]
    prompts = [_prompt(s) for s in SCHEMAS] * 2 + FREE_PROMPTS
    params = ([_json_params(s, temperature=1.0, seed=i) for i, s in enumerate(SCHEMAS)]
              + [_json_params(s) for s in SCHEMAS] + [free] * len(FREE_PROMPTS))
    outputs = smollm2.generate(prompts, params)
    for schema, output in zip(SCHEMAS * 2, outputs):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", (schema, completion.text)
        jsonschema.validate(json.loads(completion.text), schema)
    assert [o.outputs[0].token_ids for o in outputs[-len(FREE_PROMPTS):]] == alone


def test_a_few_schemas_validate_at_temperature_one_with_n_samples(smollm2):
    schemas = [SCHEMAS[5], SCHEMAS[7], SCHEMAS[11]]
    outputs = smollm2.generate([_prompt(s) for s in schemas],
                               [_json_params(s, temperature=1.0, n=2, seed=7) for s in schemas])
    for schema, output in zip(schemas, outputs):
        assert len(output.outputs) == 2
        for completion in output.outputs:
            jsonschema.validate(json.loads(completion.text), schema)


def test_regex_and_choice_outputs_match(smollm2):
    pattern = r"[0-9]{3}-[0-9]{4}"
    outputs = smollm2.generate(
        ["My phone number is", "Is the sky blue? Answer:", "Pick a fruit:"],
        [SamplingParams(max_tokens=20, temperature=1.0, seed=1, guided_decoding=GuidedDecodingParams(regex=pattern)),
         SamplingParams(max_tokens=8, temperature=1.0, n=4, seed=2,
                        guided_decoding=GuidedDecodingParams(choice=["yes", "no"])),
         SamplingParams(max_tokens=8, guided_decoding=GuidedDecodingParams(choice=["apple", "banana", "cherry"]))])
    assert re.fullmatch(pattern, outputs[0].outputs[0].text)
    assert {c.text for c in outputs[1].outputs} <= {"yes", "no"}
    assert outputs[2].outputs[0].text in {"apple", "banana", "cherry"}


def test_grammar_json_object_and_begin_after(smollm2):
    ebnf = 'root ::= "(" [a-z]+ " " [0-9]+ ")"'
    outputs = smollm2.generate(
        ["A word and a number:", "A JSON object:", "Think, then answer:"],
        [SamplingParams(max_tokens=20, guided_decoding=GuidedDecodingParams(grammar=ebnf)),
         SamplingParams(max_tokens=60, temperature=1.0, seed=3,
                        guided_decoding=GuidedDecodingParams(json_object=True)),
         SamplingParams(max_tokens=30, guided_decoding=GuidedDecodingParams(regex="(yes|no)", begin_after="\n"))])
    assert re.fullmatch(r"\([a-z]+ [0-9]+\)", outputs[0].outputs[0].text)
    assert isinstance(json.loads(outputs[1].outputs[0].text), dict)
    free_part, _, answer = outputs[2].outputs[0].text.partition("\n")
    assert answer in ("yes", "no"), outputs[2].outputs[0].text


def test_a_constrained_request_preempted_for_lack_of_blocks_still_conforms(smollm2_dir):
    schema = SCHEMAS[10]
    with LLM(model=str(smollm2_dir), executor="local", max_batch_size=8, max_seq_len=256,
             kv_cache_config=KvCacheConfig(max_tokens=384), iter_stats_max_iterations=1000) as llm:
        outputs = llm.generate([_prompt(schema)] * 4, [_json_params(schema, temperature=1.0, seed=i)
                                                      for i in range(4)])
        preempted = sum(stats["inflightBatchingStats"]["numPausedRequests"] for stats in llm.get_stats(timeout=2))
    assert preempted > 0
    for output in outputs:
        jsonschema.validate(json.loads(output.outputs[0].text), schema)


@pytest.mark.parametrize("guided, field, problem", [
    (GuidedDecodingParams(json={"type": "objekt"}), "json", "objekt"),
    (GuidedDecodingParams(json="{not json"), "json", "JSON"),
    (GuidedDecodingParams(regex="(ab"), "regex", "parenthesis"),
    (GuidedDecodingParams(grammar='root ::= "a'), "grammar", "string literal"),
    (GuidedDecodingParams(lark='start: "a'), "lark", "unterminated"),
])
def test_a_malformed_grammar_is_a_value_error_naming_its_field(guided, field, problem):
    with pytest.raises(ValueError, match=rf"guided_decoding\.{field} is not valid: .*{problem}"):
        check_guided(guided)


def test_guided_decoding_params_take_exactly_one_kind():
    with pytest.raises(ValueError, match="exactly one"):
        GuidedDecodingParams()
    with pytest.raises(ValueError, match="exactly one"):
        GuidedDecodingParams(json={"type": "object"}, regex="a")
    with pytest.raises(TypeError, match="guided_decoding.regex must be a string"):
        GuidedDecodingParams(regex=3)
    with pytest.raises(ValueError, match="use_beam_search"):
        SamplingParams(use_beam_search=True, n=2, guided_decoding=GuidedDecodingParams(json_object=True))
    assert SamplingParams(guided_decoding={"choice": ["a"]}).guided_decoding.choice == ["a"]


def test_an_invalid_schema_is_refused_at_submission_and_the_engine_goes_on(smollm2):
    with pytest.raises(ValueError, match="guided_decoding.json is not valid"):
        smollm2.generate(["x"], SamplingParams(guided_decoding=GuidedDecodingParams(json={"type": "objekt"})))
    assert smollm2.generate(["The capital of France is"], SamplingParams(max_tokens=3))[0].outputs[0].text


def test_a_model_vocabulary_padded_past_the_tokenizer_masks_the_padding(smollm2):
    """An embedding larger than the tokenizer (padding rows): the grammar covers the tokenizer's ids, and every
    padding id stays masked however high its logit."""
    import torch

    from raylm.engine.structured_output import GrammarCompiler, Guide, mask_guided_rows, tokenizer_vocab_size

    tokenizer = smollm2.tokenizer
    own = tokenizer_vocab_size(tokenizer)
    compiler = GrammarCompiler(tokenizer, vocab_size=own + 1000)
    assert compiler.vocab_size == own
    guided = GuidedDecodingParams(choice=["yes", "no"])
    compiled = compiler.compile(guided).result()
    guides = [Guide(compiled, [tokenizer.eos_token_id]) for _ in range(2)]
    logits = torch.zeros(3, own + 1000)
    logits[:, own:] = 100.0  # the padding would win every unmasked draw
    mask_guided_rows(logits, [(0, guides[0], ()), (2, guides[1], ())])
    allowed = {tokenizer.encode(word, add_special_tokens=False)[0] for word in ("yes", "no")}
    for row in (0, 2):
        assert torch.isinf(logits[row, own:]).all()
        assert set(torch.nonzero(torch.isfinite(logits[row])).flatten().tolist()) <= allowed | {
            t for t in range(own) if tokenizer.decode([t]) in ("y", "ye", "n")}
    assert (logits[1, own:] == 100.0).all()  # an unguided row is left alone
    compiler.shutdown()


def test_draft_masks_follow_each_prefix_of_the_drafts_and_leave_the_guide_where_it_was(smollm2):
    """Guide.fill_masks for a speculating sequence: row j is masked after drafts[:j] (here through the end of a
    choice and its stop token); rows past a refused draft, or past the stop, are left unmasked; the matcher is
    rolled back, so the guide accepts the same tokens afterwards."""
    import torch
    import xgrammar as xgr

    from raylm.engine.structured_output import GrammarCompiler, Guide, tokenizer_vocab_size

    tokenizer = smollm2.tokenizer
    compiler = GrammarCompiler(tokenizer, vocab_size=tokenizer_vocab_size(tokenizer))
    compiled = compiler.compile(GuidedDecodingParams(choice=["yes", "no"])).result()
    eos = tokenizer.eos_token_id
    (yes,) = tokenizer.encode("yes", add_special_tokens=False)
    (no,) = tokenizer.encode("no", add_special_tokens=False)
    guide = Guide(compiled, [eos])

    def allowed(bitmask, row):
        logits = torch.zeros(1, guide.vocab_size)
        xgr.apply_token_bitmask_inplace(logits, bitmask[row : row + 1], vocab_size=guide.vocab_size)
        return set(torch.nonzero(torch.isfinite(logits[0])).flatten().tolist())

    bitmask = xgr.allocate_token_bitmask(8, guide.vocab_size)
    assert guide.fill_masks(bitmask, 2, (yes, eos, no)) == [2, 3]  # no mask after the stop: the sequence ended
    assert {yes, no} <= allowed(bitmask, 2) and eos not in allowed(bitmask, 2)
    assert allowed(bitmask, 3) == {eos}
    assert guide.fill_masks(bitmask, 0, (no, no, yes)) == [0, 1]  # the second "no" is refused: rows past it unmasked
    assert not guide.matcher.is_terminated()
    guide.accept(yes)
    guide.accept(eos)
    assert guide.matcher.is_terminated() and not guide.broken
    compiler.shutdown()
