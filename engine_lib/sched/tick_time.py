"""How long a step takes for the cost it carries, fitted to the engine's recent ticks.

A batched step costs a fixed part that its rows share (kernel launches, Python, weights read once) plus a part
per unit of cost (latent tokens x rows). `admission_order=deadline` asks this model two things: how long a
request's steps left take (can it still make its deadline?), and whether one more row in a step costs less
than a step of its own (is batching worth delaying the running requests for?). The fixed part decides the
second: on a GPU at small sizes a step is nearly all fixed part; on the 2-CPU machine of docs/benchmarks.md
two 128x128 rows of the bench preset cost about 1.5 solo steps.

The fit is least squares over the ticks, each weighted `decay` less than the next one, so it follows the
machine when its speed drifts. Until the ticks have seen different costs (a step of one request only, say)
the fixed part is unknown: the model then counts seconds in proportion to cost (batching saves nothing,
which keeps deadline estimates on the safe side) and says batching may save time, so batches form and the
fit learns what they cost.
"""

from __future__ import annotations

from typing import Optional

MIN_SPREAD = 0.1  # the costs' weighted standard deviation over their mean below which the fixed part is unknown
WORTH_IT = 0.95  # a joined step must cost at most this share of the two separate steps


class TickTimeModel:
    """seconds(cost) = fixed_s + per_cost_s * cost. Not thread-safe (the scheduler's lock)."""

    def __init__(self, decay: float = 0.98):
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.decay = decay
        self._w = self._x = self._y = self._xx = self._xy = 0.0  # weighted sums of 1, cost, seconds, ...
        self.fixed_s: Optional[float] = None  # None: not known yet (no spread of costs)
        self.per_cost_s = 0.0

    @property
    def measured(self) -> bool:
        return self._w > 0.0

    def observe(self, cost: float, seconds: float) -> None:
        """A tick carrying `cost` took `seconds`."""
        if cost <= 0 or seconds <= 0:
            return
        d = self.decay
        self._w, self._x, self._y = d * self._w + 1.0, d * self._x + cost, d * self._y + seconds
        self._xx, self._xy = d * self._xx + cost * cost, d * self._xy + cost * seconds
        self._fit()

    def _fit(self) -> None:
        mean_x, mean_y = self._x / self._w, self._y / self._w
        var_x = self._xx / self._w - mean_x * mean_x
        self.fixed_s, self.per_cost_s = None, mean_y / mean_x  # in proportion to cost
        if var_x <= (MIN_SPREAD * mean_x) ** 2:
            return
        slope = (self._xy / self._w - mean_x * mean_y) / var_x
        fixed = mean_y - slope * mean_x
        if slope > 0.0 and fixed >= 0.0:
            self.fixed_s, self.per_cost_s = fixed, slope
        else:  # noise: a step cannot cost less with more rows, nor less than nothing without them
            self.fixed_s = 0.0

    def seconds(self, cost: float) -> float:
        """One step's seconds at `cost` (0 before any tick: every deadline counts as reachable)."""
        return (self.fixed_s or 0.0) + self.per_cost_s * cost

    def joining_saves_time(self, running_cost: float, cost: float) -> bool:
        """Whether a step of the running set with one more request of `cost` costs clearly less than the two
        steps apart (True while the fixed part is unknown: a batch is how it gets measured)."""
        if self.fixed_s is None:
            return True
        return self.seconds(running_cost + cost) <= WORTH_IT * (self.seconds(running_cost) + self.seconds(cost))
