"""What the front door's job store costs per video job: `python -m benchmarks.job_store [JOBS]`.

Each job is what the front door does for one: create, ten progress updates (each a transaction), then complete
with a 1 MiB mp4 (written, flushed to disk, renamed, committed). The store is the one the environment names
(store.open_store: SQLite in a temporary DIFFUSION_DATA_DIR unless JOB_STORE_URL is set)."""

from __future__ import annotations

import os
import sys
import tempfile
import time

from engine_lib.serving.openai_api.store import open_store

VIDEO = bytes(1 << 20)


def main() -> None:
    jobs = int(sys.argv[1]) if len(sys.argv) > 1 else 50
    with tempfile.TemporaryDirectory() as data_dir:
        store = open_store({**os.environ, "DIFFUSION_DATA_DIR": data_dir})
        start = time.perf_counter()
        for _ in range(jobs):
            job = store.add_job("bench", {"model": "m"}, max_jobs=jobs)
            for progress in range(0, 100, 10):
                store.progress(job.id, progress)
            store.complete(job.id, VIDEO, "video/mp4")
        took = (time.perf_counter() - start) / jobs
        store.close()
    print(f"{type(store).__name__}: {took * 1000:.1f} ms per job ({jobs} jobs: create, 10 progress updates, "
          f"complete with a 1 MiB mp4)")


if __name__ == "__main__":
    main()
