"""What the ranks of cfg_parallel and sequence_parallel keep of each request: its step caches.

The driver keeps every request's state; a rank runs the transformer for the batch's rows. A request's per-row
features reach the ranks with each call: its LoRA as the call's row plan (each rank's own LoRA library loads it),
its cache settings and step index as `RowFacts`. The first-block cache's residuals and TaylorSeer's factors are
those of the forwards a rank runs (its CFG branch, its share of the tokens), so they live on the rank, held by
request id (`RankStates`) until the driver's `release` frees them. `RankHandler` is what every such rank
answers besides its forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine_lib.pipelines import step_cache, taylorseer
from engine_lib.request import SamplingParams

CACHE_INPUTS = ("cache", "cache_threshold")


@dataclass(frozen=True)
class RowFacts:
    """What the ranks' cache decisions read of one request of a forward (its rows in batch order)."""

    request_id: str
    num_rows: int
    step_index: int
    cache: dict  # its cache inputs by name

    @classmethod
    def of(cls, states: list) -> list["RowFacts"]:
        return [cls(s.request_id, s.num_rows, s.step_index, {name: s.params.get(name) for name in CACHE_INPUTS})
                for s in states]


def caches(params) -> bool:
    """Whether a request keeps a step cache (first-block or TaylorSeer), whose state then lives on the ranks."""
    return step_cache.caches(params) or taylorseer.caches(params)


@dataclass
class RankState:
    """The part of a request's state a rank's forward reads (`row_groups` and `taylorseer.plan`)."""

    request_id: str
    params: SamplingParams
    num_rows: int
    step_index: int
    step_cache: dict = field(default_factory=dict)


class RankStates:
    """One rank's step caches by request id (owned by the rank's handler thread)."""

    def __init__(self):
        self._caches: dict[str, dict] = {}

    def __len__(self) -> int:
        return len(self._caches)

    def states(self, facts: list[RowFacts]) -> list[RankState]:
        """The forward's states; a request that caches gets (or keeps) its step cache here."""
        out = []
        for fact in facts:
            params = SamplingParams(fact.cache)
            held = self._caches.setdefault(fact.request_id, {}) if caches(params) else {}
            out.append(RankState(fact.request_id, params, fact.num_rows, fact.step_index, held))
        return out

    def free(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._caches.pop(request_id, None)


class RankHandler:
    """The part of a cfg_parallel or sequence_parallel rank's handler besides its forward: the step caches it holds
    (`held_states`; with its compile counter, `report`, for the metrics), freeing them, and the rows its
    transformer's blocks ran (`rows_into`)."""

    def __init__(self, adapter, rank: int, world_size: int):
        self.adapter, self.rank, self.world_size = adapter, rank, world_size
        self.held = RankStates()
        self._rows: dict[str, int] = {}  # transformer submodule -> rows that entered it (owned by the handler thread)

    def held_states(self) -> int:
        """Requests whose step cache (of this rank's forwards) this rank holds."""
        return len(self.held)

    def report(self) -> dict[str, float]:
        """What the metrics read of this rank (worker_watch.py): the states it holds and its copy's lever
        counters (the recompilations of its compiled transformer, which runs the forwards)."""
        applied = getattr(self.adapter, "levers", None)
        return {"held_states": float(self.held_states()), **(applied.counters() if applied is not None else {})}

    def free(self, request_ids: list[str]) -> None:
        self.held.free(request_ids)

    def rows_into(self, name: str) -> int:
        """Rows that entered the transformer's submodule `name` on this rank since the first call for it (a forward
        pre-hook): the block evaluations the step caches skip, counted where they run."""
        if name not in self._rows:
            self._rows[name] = 0

            def count(module, args, kwargs):
                self._rows[name] += (args[0] if args else kwargs["hidden_states"]).shape[0]

            self.adapter.pipe.transformer.get_submodule(name).register_forward_pre_hook(count, with_kwargs=True)
        return self._rows[name]
