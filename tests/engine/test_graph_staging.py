"""The decode graphs' block-table staging: rows kept from step to step equal a table built afresh."""

from __future__ import annotations

import random

import numpy as np

from raylm.engine.cuda_graphs import BlockTableStaging


def test_block_table_rows_kept_across_steps_equal_fresh_rows():
    """Sequences grow, copy their last block, leave and change places; some take several rows in a row."""
    rng = random.Random(0)
    staging = BlockTableStaging(np.zeros((16, 64), dtype=np.int32))
    sequences = [[rng.randrange(1, 1000)] for _ in range(12)]
    for step in range(400):
        for index, blocks in enumerate(sequences):
            event = rng.random()
            if event < 0.3 and len(blocks) < 64:
                blocks.append(rng.randrange(1, 1000))  # a new block, in place
            elif event < 0.35:  # copy-on-write of the last block: a new list (Sequence.block_ids)
                sequences[index] = [*blocks[:-1], rng.randrange(1, 1000)]
            elif event < 0.38:  # preempted or finished, another sequence takes the row
                sequences[index] = [rng.randrange(1, 1000) for _ in range(rng.randrange(1, 8))]
        if step % 7 == 0:
            rng.shuffle(sequences)  # the batch's order changes
        # a sequence's positions as rows of their own (a prompt in a prefill graph) share its list
        contexts = [(blocks, 16 * len(blocks)) for blocks in sequences for _ in range(rng.choice((1, 1, 2, 5)))]
        count = rng.randrange(1, 16)
        contexts = contexts[:count]
        batch = min(16, count + rng.randrange(0, 3))
        width = staging.fill(contexts, batch)
        assert width == max(len(blocks) for blocks, _ in contexts)
        for row, (blocks, _) in enumerate(contexts):
            assert staging.table[row, : len(blocks)].tolist() == blocks
        assert (staging.table[count:batch, 0] == 0).all()
