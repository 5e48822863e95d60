"""Worker processes for multi-device parallelism: one process per rank, all in one torch.distributed group.

The engine's process is the driver: it keeps the engine, the scheduler, every request's state and
the scheduler steps, and hands each rank its part of a tick's work over that rank's pipe; rank 0
sends back the result (the ranks exchange tensors among themselves with torch.distributed: gloo
on CPU, NCCL on CUDA). Every rank answers every call, so the driver and the ranks stay in step.

A worker that dies, stops sending its heartbeat (a thread of its own beats every HEARTBEAT_EVERY_S: a rank
stopped with SIGSTOP, or hung whole, is found within HEARTBEAT_TIMEOUT_S, not at the collectives' timeout of
minutes), or does not answer within the timeout, fails the call with `WorkerError`
instead of hanging the engine; the group is then broken and every later call fails at once
(the engine then ends the requests whose state it held and starts a new group: engine.py). A
handler that raises fails only its call: every rank still answers it. `close()` stops the workers
and their process group.

Messages are plain pickles on the pipe (tensors moved to the CPU first), never shared memory,
so nothing is left in /dev/shm.
"""

from __future__ import annotations

import functools
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Optional

import torch

from engine_lib.config import EngineConfig

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 300.0  # a call that takes longer fails the group
LOAD_TIMEOUT_S = 1800.0  # each rank loads the whole pipeline (a large checkpoint from disk)
STOP_TIMEOUT_S = 10.0
HEARTBEAT_EVERY_S = 0.5  # each rank's heartbeat thread writes one empty message this often
HEARTBEAT_TIMEOUT_S = 5.0  # a rank silent this long breaks the group (a busy rank's thread still beats)


class WorkerError(RuntimeError):
    """A worker died, failed its part of a call, or did not answer in time."""


def to_cpu(value: Any) -> Any:
    """Tensors (also inside lists, tuples and dicts) on the CPU, for the pipe."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_cpu(v) for v in value)
    return value


def to_rank(value: Any, device: torch.device) -> Any:
    """Tensors (also inside lists, tuples and dicts) from the pipe onto a rank's device (`to_cpu`'s reverse)."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: to_rank(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_rank(v, device) for v in value)
    return value


def rank_devices(device: torch.device, world_size: int, names: Optional[list[str]] = None) -> list[torch.device]:
    """Rank r's device: `names[r]` if given (the `devices` parameter), else the CPU for every rank, or
    cuda:r (the host needs world_size GPUs)."""
    from engine_lib.config import ConfigError
    if names:
        if len(names) != world_size:
            raise ConfigError(f"parameter 'devices': {len(names)} device(s) for {world_size} rank(s)")
        devices = [torch.device(name) for name in names]
        missing = [str(d) for d in devices if d.type == "cuda" and (d.index or 0) >= torch.cuda.device_count()]
        if missing:
            raise ConfigError(f"parameter 'devices': {', '.join(missing)} not on this host "
                              f"({torch.cuda.device_count()} CUDA devices)")
        return devices
    if device.type != "cuda":
        return [torch.device("cpu")] * world_size
    if torch.cuda.device_count() < world_size:
        raise ConfigError(f"{world_size} ranks need {world_size} CUDA devices; this host has "
                          f"{torch.cuda.device_count()}")
    return [torch.device("cuda", r) for r in range(world_size)]


class WorkerGroup:
    """`world_size` spawned workers; `setup(rank, world_size, device)` builds each rank's handler, whose methods
    `call` runs (each rank's method gets its own arguments; rank 0's return value is the call's)."""

    def __init__(self, setup: Callable, devices: list[torch.device], timeout_s: float = DEFAULT_TIMEOUT_S):
        self.world_size = len(devices)
        self.timeout_s = timeout_s
        self.broken: Optional[str] = None
        self.calls = 0  # calls every rank answered
        backend = "nccl" if devices[0].type == "cuda" else "gloo"
        context = multiprocessing.get_context("spawn")  # CUDA and an engine's threads do not survive a fork
        if not os.path.basename(sys.executable).startswith("python"):  # embedded (Triton's Python backend stub)
            context.set_executable(os.path.join(sys.prefix, "bin", "python3"))
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        self._conns, self._beats, self.processes = [], [], []
        for rank, device in enumerate(devices):
            ours, theirs = context.Pipe()
            beats, beat = context.Pipe(duplex=False)
            process = context.Process(target=_worker_main, name=f"parallel-rank{rank}", daemon=True,
                                      args=(rank, self.world_size, str(device), torch.get_num_threads(), backend,
                                            init_method, timeout_s, setup, theirs, beat))
            process.start()
            theirs.close()
            beat.close()
            self._conns.append(ours)
            self._beats.append(beats)
            self.processes.append(process)
        # Each rank's last heartbeat (None: none yet, its imports still running; only the load timeout applies).
        # The driver's thread only.
        self._heard: list[Optional[float]] = [None] * self.world_size
        try:
            self._replies(LOAD_TIMEOUT_S)  # each rank's "ready" once it has joined the group and built its handler
        except BaseException:
            self.close()
            raise
        logger.info("parallel worker group started: pids %s on %s", [p.pid for p in self.processes],
                    [str(d) for d in devices])

    def call(self, method: str, args_per_rank: list[tuple]) -> Any:
        """Run `method` on every rank (rank r with `args_per_rank[r]`); rank 0's result, on the CPU."""
        return self.call_all(method, args_per_rank)[0]

    def call_all(self, method: str, args_per_rank: list[tuple]) -> list:
        """Run `method` on every rank (rank r with `args_per_rank[r]`); every rank's result, on the CPU."""
        if self.broken:
            raise WorkerError(f"the worker group is broken ({self.broken})")
        assert len(args_per_rank) == self.world_size
        for conn, args in zip(self._conns, args_per_rank):
            try:
                conn.send_bytes(pickle.dumps((method, to_cpu(args))))
            except OSError:
                pass  # a dead rank: _replies names it
        return self._replies(self.timeout_s)

    def _replies(self, timeout_s: float) -> list:
        """One reply from each rank, waiting on their pipes and their processes at once: a rank that dies
        or stays silent past the timeout breaks the group rather than hanging the driver. A rank whose
        handler raised still answered (the ranks stay in step): its error fails this call only."""
        replies, errors = {}, []
        waiting = dict(enumerate(self._conns))
        sentinels = [p.sentinel for p in self.processes]
        deadline = time.monotonic() + timeout_s
        while waiting:
            ready = multiprocessing.connection.wait([*waiting.values(), *sentinels],
                                                    timeout=min(HEARTBEAT_EVERY_S, max(0.0, deadline - time.monotonic())))
            self._check_heartbeats()
            if not ready and time.monotonic() >= deadline:
                self._fail(f"rank(s) {sorted(waiting)} did not answer within {timeout_s:g} s")
            for rank, conn in list(waiting.items()):
                if conn in ready:
                    try:
                        status, value = pickle.loads(conn.recv_bytes())
                    except (EOFError, OSError):
                        continue  # its process ended: _check_alive says how
                    del waiting[rank]
                    if status == "error":
                        errors.append(f"rank {rank}: {value}")
                    replies[rank] = value
            self._check_alive()
        if errors:
            raise WorkerError("; ".join(errors))
        self.calls += 1
        return [replies[rank] for rank in range(self.world_size)]

    def check(self) -> Optional[str]:
        """Why the group is broken (None: it is not); a worker that died or went silent since the last call breaks
        it now."""
        if not self.broken:
            try:
                self._check_alive()
                self._check_heartbeats()
            except WorkerError:
                pass
        return self.broken

    def _check_heartbeats(self) -> None:
        now = time.monotonic()
        for rank, beats in enumerate(self._beats):
            try:
                while beats.poll():
                    beats.recv_bytes()
                    self._heard[rank] = now
            except (EOFError, OSError):
                continue  # its process ended: _check_alive says how
        silent = [rank for rank, heard in enumerate(self._heard) if heard is not None and now - heard > HEARTBEAT_TIMEOUT_S]
        if silent:
            self._fail(f"rank(s) {silent} (pid {', '.join(str(self.processes[r].pid) for r in silent)}) sent no "
                       f"heartbeat for {HEARTBEAT_TIMEOUT_S:g} s")

    def _check_alive(self) -> None:
        for rank, process in enumerate(self.processes):
            if not process.is_alive():
                self._fail(f"rank {rank} (pid {process.pid}) died with exit code {process.exitcode}")

    def _fail(self, reason: str) -> None:
        self.broken = reason
        logger.error("parallel worker group: %s", reason)
        raise WorkerError(reason)

    def close(self) -> None:
        """Stop every worker (each leaves its process group), kill one that does not stop, close the pipes."""
        for conn in self._conns:
            try:
                conn.send_bytes(pickle.dumps(("stop", ())))
            except OSError:
                pass
        for process in self.processes:  # a broken group's survivors may wait in a collective: no grace
            process.join(1.0 if self.broken else STOP_TIMEOUT_S)
            if process.is_alive():
                process.kill()
                process.join()
        for conn in [*self._conns, *self._beats]:
            conn.close()
        self._conns, self._beats, self.broken = [], [], self.broken or "closed"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _beat(conn) -> None:
    """A rank's heartbeat, from a thread of its own: it beats while the rank computes or waits in a collective,
    and stops only with the whole process (stopped, hung, gone)."""
    while True:
        try:
            conn.send_bytes(b"")
        except OSError:
            return  # the driver is gone
        time.sleep(HEARTBEAT_EVERY_S)


def _worker_main(rank: int, world_size: int, device: str, threads: int, backend: str, init_method: str,
                 timeout_s: float, setup: Callable, conn, beat) -> None:
    """One rank: join the group, build the handler, then answer calls until "stop" (or the driver is gone)."""
    import torch.distributed as dist

    threading.Thread(target=_beat, args=(beat,), name="heartbeat", daemon=True).start()

    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:  # the driver's CPU kernels (their blocking follows the thread count): a rank computes what it would
        torch.set_num_threads(threads)
    try:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        handler = setup(rank, world_size, device)
        conn.send_bytes(pickle.dumps(("ok", None)))
    except Exception:
        conn.send_bytes(pickle.dumps(("error", traceback.format_exc(limit=4))))
        return
    try:
        while True:
            try:
                method, args = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                break  # the driver is gone
            if method == "stop":
                break
            try:
                result = to_cpu(getattr(handler, method)(*to_rank(args, device)))
                conn.send_bytes(pickle.dumps(("ok", result)))
            except Exception:
                conn.send_bytes(pickle.dumps(("error", traceback.format_exc(limit=4))))
    finally:
        dist.destroy_process_group()
    # Skip the interpreter's teardown (seconds of freeing a loaded pipeline): the rank owns no files to flush.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def start_pipeline_ranks(rank_class: type, adapter_cls: type, model_path: str, device: torch.device,
                         dtype: torch.dtype, config: EngineConfig, world_size: int,
                         timeout_s: float = DEFAULT_TIMEOUT_S) -> WorkerGroup:
    """`world_size` workers, each loading the pipeline (`adapter_cls.load`) on its device and answering calls with
    `rank_class(adapter, rank, world_size)` (cfg_parallel.py, sequence_parallel.py)."""
    setup = functools.partial(_load_pipeline_rank, rank_class, adapter_cls, model_path, dtype, config)
    return WorkerGroup(setup, rank_devices(device, world_size, config.parallel.device_list()), timeout_s)


def _load_pipeline_rank(rank_class: type, adapter_cls: type, model_path: str, dtype: torch.dtype, config: EngineConfig,
                        rank: int, world_size: int, device: torch.device) -> Any:
    return rank_class(adapter_cls.load(model_path, device, dtype, config), rank, world_size)


def agree(error: Optional[BaseException], device: torch.device) -> None:
    """In a rank handler, before it exchanges results: every rank learns whether every rank's part succeeded (an
    all_reduce), then raises `error`, or a RuntimeError where another rank failed, so none waits in a collective
    that a failed rank never joins."""
    import torch.distributed as dist

    ok = torch.tensor([0 if error else 1], device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if error is not None:
        raise error
    if not ok.item():
        raise RuntimeError("another rank's part of this call failed")
