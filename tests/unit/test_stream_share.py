"""The rule for which documents of a stream each data rank reads, and how a resume on another
number of ranks continues: simulated over random document lengths and chains of changes, every
token of every document is a target exactly once. test_hf_source.py checks the same of the real
reader through the loader."""

from __future__ import annotations

import itertools
import random

import pytest

from kiln.data.stream_share import DONE, Layout, Position, relayout, resume_positions


def read_tokens(
    layout: Layout, positions: list[Position], lengths: list[int], budget: int, seen: list[int]
) -> list[Position]:
    """Each rank trains on `budget` more targets of its share from its position, counting each
    into `seen` (targets per document); returns the positions as the reader reports them: the
    last target's token, which the next window starts with."""
    moved = []
    for rank, position in enumerate(positions):
        left, last = budget, None
        starts = {position.document: position.trained}
        for document, trained in layout.share(rank, first=position.document):
            if document >= len(lengths) or not left:
                break
            trained = starts.pop(document, trained)
            take = min(left, lengths[document] - trained)
            seen[document] += take
            left -= take
            if take:
                last = (document, trained + take - 1)
        moved.append(Position(*last, position.sample + 1) if last else position)
    return moved


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("skewed", [False, True])
def test_a_chain_of_rank_count_changes_trains_every_token_once(seed, skewed):
    rng = random.Random(seed)
    lengths = [rng.choice([0, 1, 3, 17, 40, 150]) for _ in range(3000)]
    if skewed:  # even documents long, odd ones short: at 2 ranks, rank 1 runs far ahead
        lengths = [150 if d % 2 == 0 else rng.choice([0, 1, 2]) for d in range(3000)]
    seen = [0] * len(lengths)
    layout, positions, _ = resume_positions(None, 2)
    for ranks in [2, 3, 1, 4, 4, 2, 5]:
        state = {
            **layout.to_state(),
            "positions": [p.__dict__ for p in positions],
        }
        layout, positions, note = resume_positions(state, ranks)
        assert (note is None) == (len(state["positions"]) == ranks)
        positions = read_tokens(layout, positions, lengths, rng.randint(50, 700), seen)
    frontier = min(p.document for p in positions)
    # Exact: every token before every rank's position a target once, none twice.
    assert all(count <= length for count, length in zip(seen, lengths, strict=True))
    assert seen[:frontier] == lengths[:frontier]
    assert len(layout.earlier) <= 4  # past layouts are dropped once every rank is past them


def first_documents(layout: Layout, *, rank: int, first: int, count: int = 4) -> list[int]:
    return [document for document, _ in itertools.islice(layout.share(rank, first=first), count)]


def test_the_shares_partition_the_stream_and_a_change_skips_what_was_read():
    layout = Layout(ranks=3)
    assert first_documents(layout, rank=1, first=1) == [1, 4, 7, 10]
    # Rank 0 read documents 0 and 3 and 5 tokens of 6; rank 1 only 2 tokens of 1; rank 2 read
    # documents 2, 5, 8 and is at the start of 11.
    positions = [Position(6, 5), Position(1, 2), Position(11, 0)]
    new = relayout(layout, positions, 2)
    assert new.start == 1
    statuses = {d: new.status(d) for d in range(0, 13)}
    assert statuses == {
        0: DONE, 1: 2, 2: DONE, 3: DONE, 4: 0, 5: DONE, 6: 5,
        7: 0, 8: DONE, 9: 0, 10: 0, 11: 0, 12: 0,
    }  # fmt: skip
    # New rank 0 reads 1 (from token 2), 3 is done, then 5 done, 7, 9, 11; rank 1: 2 done, 4, 6...
    assert first_documents(new, rank=0, first=1) == [1, 7, 9, 11]
    assert list(zip(range(3), new.share(1, first=2), strict=False)) == [
        (0, (4, 0)),
        (1, (6, 5)),
        (2, (10, 0)),
    ]
    # A rank that has taken windows trained on the token its next one starts with too; so did
    # the single reader of an older kiln (one position, no layout).
    new, moved, _ = resume_positions({"document": 5, "offset": 2, "sample": 3}, 2)
    assert (new.start, new.status(5), moved) == (5, 3, [Position(5, 3), Position(6, 0)])
