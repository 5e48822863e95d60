"""Pure-Python scheduling: request ids, compatibility keys and step counts, never tensors (no torch)."""

from engine_lib.sched.base import KeyFn, RunnerOutput, Scheduler, SchedulerOutput
from engine_lib.sched.keys import RequestBatchKey, StepBatchKey, request_batch_key, step_batch_key
from engine_lib.sched.request_scheduler import RequestScheduler, wait_for_admission
from engine_lib.sched.step_scheduler import StepScheduler

__all__ = [
    "KeyFn",
    "RequestBatchKey",
    "RequestScheduler",
    "RunnerOutput",
    "Scheduler",
    "SchedulerOutput",
    "StepBatchKey",
    "StepScheduler",
    "request_batch_key",
    "step_batch_key",
    "wait_for_admission",
]
