"""StepScheduler: step mode, where requests join and leave the running batch between denoise steps.

The running set holds requests of one key, up to `max_num_seqs` and within the
compute budget (`max_batch_tokens`). Between ticks, waiting requests join in
queue order while they fit and their key matches the running set's (any key
when it is empty). The queue order (`Scheduler.urgency`): most urgent
`priority` first (1 is the most urgent); within a level the oldest first, or
with `admission_order=shortest_remaining` the fewest steps left first, or with
`admission_order=deadline` the earliest deadline that can still be made first
(`Scheduler.deadline_rank`), and a request joins the running set only when
sharing steps pays (`_batching_pays`: a shared step costs clearly less than
two, and no member that can make its deadline is made late by it).

- **Preemption.** When the head of the queue cannot join and is more urgent
  than running requests (a better priority, or under shortest_remaining also
  fewer steps left, or under deadline a more pressing deadline), those pause
  between two steps (least urgent first, the latest admitted first among
  equals) until it can: a compatible head
  needs a seat and room in the budget, an incompatible one needs the whole set
  to pause, or nothing pauses. A paused request keeps its runner state and
  waits at its place in the queue; it resumes where it stopped. Each
  request pauses at most `max_preemptions` times (0: no preemption).
- **Passing, bounded.** When the head still cannot join, requests of its
  priority behind it that can may pass it (the first in queue order); under
  shortest_remaining shorter requests also pass older ones. A waiting request
  is passed at most `max_head_bypass` times: then it counts as having no steps
  left, goes first, and when it cannot join it waits only for the running set
  to drain. `max_head_bypass=0` is the seed's FIFO, where an incompatible head
  blocks everyone behind it (head-of-line blocking). A less urgent request
  never passes a more urgent one.

With `separate_priorities` (`priority_batching=separate`) a batch holds one
priority level: a more urgent head is incompatible with a less urgent running
set, so it pauses the whole set (or waits for it to drain) and runs without it.

Requests with different step counts and at different steps share ticks; the
runner reports each one's progress.
"""

from __future__ import annotations

from typing import Optional

from engine_lib.request import DiffusionRequest
from engine_lib.sched.base import CostFn, KeyFn, Scheduler, SchedulerOutput


class StepScheduler(Scheduler):
    """Continuous batching over denoise steps. Not thread-safe: the engine locks."""

    def __init__(self, max_num_seqs: int, key_fn: KeyFn, max_head_bypass: int = 0, cost_fn: Optional[CostFn] = None,
                 max_batch_tokens: int = 0, max_preemptions: int = 0, admission_order: str = "arrival",
                 separate_priorities: bool = False):
        super().__init__(max_num_seqs, key_fn, cost_fn, max_batch_tokens, max_head_bypass, admission_order)
        if max_preemptions < 0:
            raise ValueError(f"max_preemptions must be >= 0, got {max_preemptions}")
        self.max_preemptions = max_preemptions
        self.separate_priorities = separate_priorities  # a batch holds one priority level (priority_batching)
        self._ran_before: set[str] = set()  # the running set when this schedule() began

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_ids=self._take_ended_ids())
        out.running_ids = list(self._running)
        self._ran_before = set(self._running)
        self._sort_waiting()
        while self._waiting:
            head = self._waiting[0]
            if self._can_join(head) or self._make_room(out, head):
                self._admit(out)
                continue
            if len(self._running) >= self.max_num_seqs:
                break
            if head.num_passed >= self.max_head_bypass:
                break
            match = next((r for r in self._waiting if r.priority == head.priority and self._can_join(r)), None)
            if match is None:
                break
            self._admit(out, match)  # counts the pass
        return out

    def _can_join(self, request: DiffusionRequest) -> bool:
        if not self._running:
            return True
        return (len(self._running) < self.max_num_seqs and self._compatible(request) and self._fits_budget(request)
                and self._batching_pays(request))

    def _batching_pays(self, request: DiffusionRequest) -> bool:
        """Under `deadline` order: whether `request` sharing the running set's steps is worth it. It is when a
        step with it costs clearly less than the two steps apart (`TickTimeModel.joining_saves_time`: else
        running them one after the other finishes the first sooner and the second no later), and every one
        of them that can still make its deadline alone still makes it at the shared step's time for all its
        steps left. Otherwise it waits for a seat that keeps them."""
        if self.admission_order != "deadline":
            return True
        running_cost = sum(self.cost(i) for i in self._running)
        if not self.tick_time.joining_saves_time(running_cost, self.cost(request.request_id)):
            return False
        shared_cost, now = running_cost + self.cost(request.request_id), self.clock()
        return all(now + self.work_left_s(r, shared_cost) <= r.deadline
                   for r in (*self._running.values(), request)
                   if r.deadline is not None and now + self.work_left_s(r) <= r.deadline)

    def _compatible(self, request: DiffusionRequest) -> bool:
        """The running set's key (and, with separate_priorities, its priority level)."""
        first = next(iter(self._running.values()))
        return self._keys[request.request_id] == self._keys[first.request_id] and (
            not self.separate_priorities or request.priority == first.priority)

    def _make_room(self, out: SchedulerOutput, head: DiffusionRequest) -> bool:
        """Pause less urgent running requests until `head` can join; pause none if that cannot work.
        Only requests that ran before this tick may pause (a new one has no state to keep yet)."""
        victims = [r for r in self._running.values() if r.request_id in self._ran_before
                   and self.urgency(r) > self.urgency(head) and r.num_preemptions < self.max_preemptions]
        victims.reverse()
        victims.sort(key=self.urgency, reverse=True)  # least urgent first; among equals, the latest admitted
        if not victims:
            return False
        if not self._compatible(head):
            chosen = victims if len(victims) == len(self._running) else []
        else:
            chosen = []
            for victim in victims:
                if self._room_after(chosen, head):
                    break
                chosen.append(victim)
            if not self._room_after(chosen, head):
                chosen = []
        for victim in chosen:
            self._preempt(out, victim)
            out.running_ids.remove(victim.request_id)
        return bool(chosen)

    def _room_after(self, paused: list[DiffusionRequest], head: DiffusionRequest) -> bool:
        """Whether `head` would fit (a seat and the budget) once `paused` have left the running set."""
        left = [i for i in self._running if i not in {r.request_id for r in paused}]
        return not left or (len(left) < self.max_num_seqs and self._fits_budget(head, left))
