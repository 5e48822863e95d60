"""Pure-Python scheduling: request ids, compatibility keys and step counts, never tensors (no torch)."""

from engine_lib.sched.keys import RequestBatchKey, StepBatchKey, request_batch_key, step_batch_key
from engine_lib.sched.outputs import RunnerOutput, SchedulerOutput
from engine_lib.sched.policy import POLICIES, SchedulingPolicy, make_policy
from engine_lib.sched.scheduler import KeyFn, Scheduler

__all__ = [
    "KeyFn",
    "POLICIES",
    "RequestBatchKey",
    "RunnerOutput",
    "Scheduler",
    "SchedulerOutput",
    "SchedulingPolicy",
    "StepBatchKey",
    "make_policy",
    "request_batch_key",
    "step_batch_key",
]
