"""Where a stream of fetches stands, and resuming it under another shard count.

Design notes: docs/reference/design.md#pipeline-resume.
"""

from __future__ import annotations

import dataclasses

from grain_cells.pipeline._stage import FetchPlan, count_minibatches


@dataclasses.dataclass
class Position:
    """An iterator's position (its state, less the stamp)."""

    origin: int = 0
    count: int = 1
    index: int = 0
    pieces: list = dataclasses.field(default_factory=list)
    fetch: int = 0
    minibatch: int = 0
    step: int = 0
    epoch: int = 0

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["pieces"] = [[list(map(int, p)), int(k)] for p, k in self.pieces]
        return d

    def plan(self, sampler, blocks_per_fetch: int) -> FetchPlan:
        """The fetch plan of this position's shard."""
        where = {k: getattr(self, k) for k in ("count", "index", "origin", "pieces")}
        return FetchPlan(sampler, blocks_per_fetch, epoch=self.epoch, **where)


def _cursor(plan: FetchPlan, counts, step: int) -> tuple[int, int]:
    """(fetch, minibatch) of `plan`'s shard after `step` minibatches."""
    n, left, total = 0, step, plan.num_fetches()
    while n < total:
        emitted = counts(plan.positions(n)) - plan.skip(n)
        if left < emitted:
            return n, plan.skip(n) + left
        left -= emitted
        n += 1
    return total, 0


def hand_over(
    saved: Position, sampler, source, config, new_count: int, new_index: int
) -> Position:
    """The position of shard `new_index` of `new_count` that resumes `saved`.

    `saved` was taken at the same step as every other shard's; the result
    stands at the start of the new plan (its pieces first).
    """
    g = config.blocks_per_fetch

    def counts(positions):
        plan = saved.plan(sampler, g)
        return count_minibatches(config, source, plan.keys(positions))

    old = [
        dataclasses.replace(saved, index=r).plan(sampler, g) for r in range(saved.count)
    ]
    cursors = [_cursor(plan, counts, saved.step) for plan in old]
    # The furthest plan fetch any old shard has begun (-1: none). A shard at
    # the start of fetch n (nothing of it emitted) has begun only n - 1: at
    # fetch boundaries nothing is handed over as a piece, and the new shards
    # continue the stream evenly.
    furthest = max(
        n - plan.own_pieces - (j <= plan.skip(n))
        for plan, (n, j) in zip(old, cursors, strict=True)
    )
    furthest = max(furthest, -1)
    left_pieces, plan_pieces = [], []
    for r, (plan, (n, j)) in enumerate(zip(old, cursors, strict=True)):
        total = plan.num_fetches()
        last = min(total - 1, plan.own_pieces + furthest)
        for m in range(n, last + 1):
            positions = plan.positions(m)
            skip = j if m == n else plan.skip(m)
            if positions.size == 0 or skip >= counts(positions):
                continue
            piece = (positions.tolist(), int(skip))
            if m < plan.own_pieces:
                left_pieces.append(piece)
            else:
                plan_pieces.append((m - plan.own_pieces, r, piece))
    plan_pieces.sort(key=lambda t: t[:2])
    pieces = left_pieces + [p for *_, p in plan_pieces]
    origin = saved.origin + (furthest + 1) * g * saved.count
    position = Position(origin, new_count, new_index, pieces, 0, 0, 0, saved.epoch)
    position.minibatch = position.plan(sampler, g).skip(0)
    return position
