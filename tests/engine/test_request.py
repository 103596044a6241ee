"""Request state (engine/request.py): the sampler's row of a sequence, made by the request that owns it."""

from __future__ import annotations

from raylm.engine.request import Request
from raylm.sampling_params import SamplingParams


def test_sampling_rows_are_made_once_for_sequences_whose_row_never_changes():
    def rows_of_two_steps(params: SamplingParams):
        request = Request("r", [1, 2, 3], params)
        seq = request.sequences[0]
        return request.sampling_row(seq), request.sampling_row(seq)

    first, second = rows_of_two_steps(SamplingParams(max_tokens=4, temperature=0.8, seed=1))
    assert second is first and first.output_token_ids == () and first.generator is not None
    # Rows that read the output so far (penalties, min_tokens) or draw several samples are made every step.
    for params in (SamplingParams(presence_penalty=0.5), SamplingParams(min_tokens=2),
                   SamplingParams(n=2, temperature=1.0)):
        first, second = rows_of_two_steps(params)
        assert second is not first
