"""Which documents of a stream each data rank reads, and where each continues after a resume.

Data rank r of R reads documents start + r, start + r + R, start + r + 2R, ... of the stream
(its share) and packs them into its own windows. A resume at the same R continues every rank at
its saved position. A resume at another R (a new layout) starts the new ranks' shares at the
lowest document any old rank still had to train on; the documents the old ranks had trained on
whole are skipped, and one they were in the middle of continues at its first token that was not
yet a target, so every token is a target exactly once. What the old ranks had trained on is kept
as an earlier layout until every new rank has passed its last document.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

DONE = -1  # a document's status when an earlier layout read all of it


@dataclass(frozen=True)
class EarlierLayout:
    """How far each rank of a past layout had trained when it was replaced: rank r's share started
    at `start` + r with stride `ranks`; every token of its documents before `documents[r]` had
    been a target, and the first `offsets[r]` of that one (0: none, whatever an earlier layout
    did)."""

    start: int
    ranks: int
    documents: tuple[int, ...]
    offsets: tuple[int, ...]

    def status(self, document: int, earlier: int) -> int:
        """Tokens of `document` trained on (targets) by the end of this layout (DONE: all), given
        `earlier`, its status before this layout began."""
        if document < self.start:
            return earlier
        rank = (document - self.start) % self.ranks
        if document < self.documents[rank]:
            return DONE
        if document == self.documents[rank] and self.offsets[rank]:
            return self.offsets[rank]
        return earlier  # not reached by this layout: as it was before


@dataclass(frozen=True)
class Layout:
    """The striping in effect: `ranks` data ranks from document `start` on, after the `earlier`
    layouts (oldest first) whose reads are still ahead of some new rank."""

    start: int = 0
    ranks: int = 1
    earlier: tuple[EarlierLayout, ...] = field(default_factory=tuple)

    def status(self, document: int) -> int:
        """Tokens of `document` trained on before this layout began (DONE: all of it)."""
        if document < self.start:
            return DONE
        read = 0
        for layout in self.earlier:
            read = layout.status(document, read)
        return read

    def share(self, rank: int, *, first: int) -> Iterator[tuple[int, int]]:
        """(document, tokens of it already trained on) of rank `rank`'s share from document
        `first` on, leaving out the documents an earlier layout trained on whole."""
        document = first
        while True:
            read = self.status(document)
            if read != DONE:
                yield document, read
            document += self.ranks

    def first_document(self, rank: int) -> tuple[int, int]:
        """Where rank `rank` starts in this layout: its first document not trained on whole, and
        the tokens of it that were."""
        return next(self.share(rank, first=self.start + rank))

    def to_state(self) -> dict[str, Any]:
        return {
            "start": self.start,
            "ranks": self.ranks,
            "earlier": [
                {
                    "start": e.start,
                    "ranks": e.ranks,
                    "documents": list(e.documents),
                    "offsets": list(e.offsets),
                }
                for e in self.earlier
            ],
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Layout:
        earlier = tuple(
            EarlierLayout(e["start"], e["ranks"], tuple(e["documents"]), tuple(e["offsets"]))
            for e in state.get("earlier", [])
        )
        return cls(start=state["start"], ranks=state["ranks"], earlier=earlier)


@dataclass(frozen=True)
class Position:
    """One rank's place in its share: the next document not fully trained on, a token of it, and
    the windows this rank has taken in its layout. Windows overlap by one token, so after a window
    (`sample` > 0) `offset` is the token the next one starts with, which was the last one's final
    target; before any (`sample` 0) it is the first token not yet a target."""

    document: int
    offset: int
    sample: int = 0

    @property
    def trained(self) -> int:
        """Tokens of `document` that have been targets (by this rank or an earlier layout)."""
        return self.offset + 1 if self.sample else self.offset


def relayout(layout: Layout, positions: list[Position], ranks: int) -> Layout:
    """The layout that continues `positions` (one per rank of `layout`) on `ranks` ranks."""
    assert len(positions) == layout.ranks, (len(positions), layout.ranks)
    past = EarlierLayout(
        layout.start,
        layout.ranks,
        tuple(p.document for p in positions),
        tuple(p.trained for p in positions),
    )
    start = min(past.documents)
    # Every document before `start` is done; a past layout that trained on nothing at or after it
    # decides nothing any more.
    kept = tuple(e for e in (*layout.earlier, past) if max(e.documents) >= start)
    return Layout(start=start, ranks=ranks, earlier=kept)


def resume_positions(
    saved: dict[str, Any] | None, ranks: int
) -> tuple[Layout, list[Position], str | None]:
    """The layout and every rank's position continuing a saved stream state on `ranks` data
    ranks, and what was done when the number of ranks changed (None: nothing to say)."""
    if saved is None:
        layout = Layout(ranks=ranks)
        return layout, [Position(*layout.first_document(r)) for r in range(ranks)], None
    if "positions" not in saved:
        # Written by a kiln whose every rank read the whole stream: one reader's position.
        position = {key: saved[key] for key in ("document", "offset", "sample")}
        saved = {"start": 0, "ranks": 1, "positions": [position]}
    layout = Layout.from_state(saved)
    positions = [Position(p["document"], p["offset"], p["sample"]) for p in saved["positions"]]
    if layout.ranks == ranks:
        return layout, positions, None
    new = relayout(layout, positions, ranks)
    moved = [Position(*new.first_document(r)) for r in range(ranks)]
    note = (
        f"saved by {layout.ranks} data rank(s), continued on {ranks}: rank r now reads documents "
        f"{new.start} + r, {new.start} + r + {ranks}, ..., skipping the documents (and parts of "
        "documents) already trained on, so every token is a target exactly once"
    )
    return new, moved, note
