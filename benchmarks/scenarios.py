"""Every benchmark scenario, in one table: `make bench SCENARIO=<name>` runs one, `make bench` all of them.

A scenario names the systems it puts side by side (each a tritonserver with its own config.pbtxt parameters, except
where the scenario says "in-process"), the workload they all receive (the `Scenario` fields), and how it is sent:
its `kind`, the name of its runner in benchmarks/run.py (RUNNERS), whose docstring says what a round does.

`QUICK` is `make bench-quick`: a few scenarios with fewer requests and repeats."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping, Optional

from benchmarks.systems import System, engine, naive


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    kind: str
    systems: tuple = ()
    preset: str = "bench"  # the random-weight preset of every system's pipeline (engine_lib.pipelines.tiny_models)
    sizes: tuple = (128,)  # square image sizes, drawn uniformly per request
    steps: tuple = (8,)  # denoising steps, drawn uniformly per request
    num_frames: int = 0  # video pipelines
    loras: tuple = ("",)  # LoRA names the requests cycle through ("" = none)
    preview_interval: int = 0
    concurrency: tuple = (8,)  # closed loop; profile: the batch size
    per_client: int = 3  # closed loop: requests per point = max(per_client x concurrency, min_requests)
    min_requests: int = 2
    requests: int = 40  # poisson: per round; priority: urgent requests; perf_analyzer: per run
    repeats: int = 3  # rounds; each round runs every system once, one after the other
    load: float = 0.8  # poisson: share of the first system's capacity
    slo_factor: float = 3.0
    offline: bool = False  # closed: also time the pipeline in-process at batch 1 and the largest concurrency
    variants: tuple = ()  # closed: (label, {field: value}) workloads, each run on every system
    background: int = 8  # priority: closed-loop background clients
    cache_threshold: float = 0.0  # cache: the first_block arm's threshold
    edit_strength: float = 0.0  # > 0: image-to-image edits, each request its own input image at this strength
    compare_images: bool = False  # closed: each image against the same request's on its pipeline's first system
    rows_per_request: int = 1  # rows a request puts in a forward (2: classifier-free guidance), for the tables
    max_new_tokens: int = 0  # think: the cap of each thinking request's thought


def modes(n: int = 8, wait_ms: int = 20) -> dict[str, System]:
    """Qwen-Image's execution modes and scheduling policies, by name."""
    step = dict(step_execution="true", max_num_seqs=n)
    systems = [
        System("serial", "REQUEST_BATCH serial", parameters=engine(step_execution="false", max_num_seqs=1)),
        System("fused", f"REQUEST_BATCH fused x{n}", parameters=engine(step_execution="false", max_num_seqs=n)),
        System("fused_wait", f"REQUEST_BATCH fused x{n} + {wait_ms} ms wait", parameters=engine(
            step_execution="false", max_num_seqs=n, request_batch_max_wait_ms=wait_ms)),
        System("step", f"STEP_BATCH continuous x{n}", parameters=engine(**step)),
        System("step_mixed", f"STEP_BATCH continuous x{n}, mixed_size_batching",
               parameters=engine(**step, mixed_size_batching="true")),
        System("step_srpt", "STEP_BATCH x2, shortest remaining first", parameters=engine(
            step_execution="true", max_num_seqs=2, scheduling_policy="shortest_remaining", max_preemptions=1)),
        System("step_deadline", "STEP_BATCH x2, earliest deadline first (SLOs sent as timeouts)", deadlines=True,
               parameters=engine(step_execution="true", max_num_seqs=2, scheduling_policy="deadline",
                                 max_preemptions=3)),
        naive(),
    ]
    return {s.name: s for s in systems}


def serial_vs_step(pipeline: str, n: int, fused_wait_ms: Optional[int] = None, **extra) -> tuple:
    """A pipeline one request at a time and with step batching (and fused request batching if asked)."""
    out = [System(f"{pipeline}_serial", f"{pipeline}: serial (max_num_seqs=1)", pipeline,
                  engine(step_execution="false", max_num_seqs=1, **extra))]
    if fused_wait_ms is not None:
        out.append(System(f"{pipeline}_fused", f"{pipeline}: REQUEST_BATCH fused x{n} + {fused_wait_ms} ms wait",
                          pipeline, engine(step_execution="false", max_num_seqs=n,
                                           request_batch_max_wait_ms=fused_wait_ms, **extra)))
    out.append(System(f"{pipeline}_step", f"{pipeline}: STEP_BATCH continuous x{n}", pipeline,
                      engine(step_execution="true", max_num_seqs=n, **extra)))
    return tuple(out)


M = modes()
TINY_QWEN_STEP = System("step", "STEP_BATCH continuous x8", parameters=engine(step_execution="true", max_num_seqs=8))
PRIORITY = dict(step_execution="true", max_num_seqs=4)

SCENARIOS: dict[str, Scenario] = {s.name: s for s in [
    Scenario("modes", "The four modes side by side, a naive Triton baseline and the offline limit", "closed",
             tuple(M[n] for n in ("serial", "fused", "fused_wait", "step", "naive")), preview_interval=4,
             concurrency=(1, 2, 4, 8, 16), offline=True),
    Scenario("slo", "Poisson arrivals of mixed step counts: SLO attainment per scheduling policy", "poisson",
             tuple(M[n] for n in ("serial", "fused_wait", "step", "step_srpt", "step_deadline")),
             steps=(4, 8, 16), preview_interval=4),
    Scenario("mixed-sizes", "Mixed image sizes: step batches keyed by size vs packed", "closed",
             tuple(M[n] for n in ("step", "step_mixed")), sizes=(64, 128), per_client=6),
    Scenario("packing", "Mixed sizes in one forward: packed vs per size vs padded (in-process)", "packing",
             preset="tiny", repeats=15),
    Scenario("profile", "Where the time goes: one request's phases solo and batched (in-process)", "profile",
             repeats=3),
    Scenario("perf-analyzer", "perf_analyzer cross-check against the step-batching server", "perf_analyzer",
             (M["step"],), preview_interval=4, concurrency=(4,), requests=24),
    Scenario("lora", "LoRA per request: three LoRAs sharing forwards vs one LoRA", "closed", (TINY_QWEN_STEP,),
             preset="tiny", sizes=(64,), per_client=12,
             variants=(("none, toy_a, toy_b cycling", {"loras": ("", "toy_a", "toy_b")}),
                       ("toy_a only", {"loras": ("toy_a",)}), ("no LoRA", {"loras": ("",)}))),
    Scenario("priority", "An urgent request alone and under a full background load", "priority", (
        System("preempt", "priority 1, max_preemptions=1", parameters=engine(**PRIORITY, max_preemptions=1)),
        System("no_preempt", "priority 1, max_preemptions=0", parameters=engine(**PRIORITY, max_preemptions=0)),
        System("separate", "priority 1, scheduling_policy=separate_priorities", parameters=engine(
            **PRIORITY, max_preemptions=1, scheduling_policy="separate_priorities"))),
        preset="tiny", sizes=(64,), requests=60, repeats=1),
    # 0.8 reuses about half the steps of the `bench` preset at 128x128 and 8 steps (9 to 15 of 24 between 0.7 and 0.8).
    Scenario("step-cache", "First-block cache per request in a step batch: off vs first_block, interleaved", "cache",
             (M["step"],), concurrency=(8,), per_client=3, cache_threshold=0.8),
    Scenario("pipelines", "Flux and SD3: serial vs step batching", "closed",
             serial_vs_step("flux", 8, max_sequence_length=32) + serial_vs_step("sd3", 8, max_sequence_length=32),
             preset="tiny", sizes=(64,), steps=(4,), concurrency=(1, 8), per_client=2, min_requests=8, repeats=1),
    # SD3 image-to-image: its step batches take rows of different images and strengths (no key on the image), and
    # a tiny step at 64x64 is cheap here; Kontext batches one condition size only and doubles each row's tokens.
    Scenario("edits", "Edits (SD3 image-to-image, a different image per request): serial vs step batching", "closed",
             serial_vs_step("sd3", 8, max_sequence_length=32), preset="tiny", sizes=(64,), steps=(8,),
             edit_strength=0.5, compare_images=True, rows_per_request=2, concurrency=(8,), per_client=8),
    Scenario("own-models", "Own model code (BAGEL, HunyuanImage-3.0): step batching vs serial", "closed",
             serial_vs_step("bagel", 4) + serial_vs_step("hunyuan_image3", 4), preset="tiny", sizes=(64,),
             concurrency=(4,), per_client=16),
    Scenario("ltx2", "Video, LTX-2: serial vs fused vs step batching", "closed",
             serial_vs_step("ltx2", 4, fused_wait_ms=20), preset="tiny", sizes=(64,), steps=(4, 8), num_frames=17,
             concurrency=(4,), per_client=6),
    Scenario("helios", "Video, Helios: first chunk vs the whole video", "closed", (System(
        "helios", "helios: one request at a time, streamed by chunk", "helios",
        engine(step_execution="true", max_num_seqs=1)),), preset="tiny", sizes=(64,), steps=(4,), num_frames=97,
             concurrency=(1,), per_client=6),
    # Each lever of engine_lib/pipelines/levers.py alone and combined, with the step cache off and on (in-process).
    Scenario("levers", "GPU levers: eager, compile, int8, fp8, compile+fp8, each with and without first_block "
             "(in-process)", "levers", sizes=(128,), steps=(8,), concurrency=(4,), repeats=3),
    # Every other request thinks (a thought of up to 24 tokens, then 8 denoise steps); the baseline is the same
    # engine with at most one request decoding per tick (BagelAdapter.max_text_rows, a benchmark-only setting).
    Scenario("think", "BAGEL think and plain requests at concurrency 8: one loop vs text phases one at a time "
             "(in-process)", "think", (
                 System("one_loop", "bagel: STEP_BATCH x8, every text phase in one text forward per tick", "bagel",
                        engine(step_execution="true", max_num_seqs=8)),
                 System("text_one_at_a_time", "bagel: STEP_BATCH x8, max_text_rows=1 (one request decodes per tick)",
                        "bagel", engine(step_execution="true", max_num_seqs=8), adapter={"max_text_rows": 1})),
             preset="tiny", sizes=(64,), steps=(8,), concurrency=(8,), per_client=3, repeats=3, max_new_tokens=24),
]}

QUICK: dict[str, Mapping] = {
    "modes": dict(systems=tuple(M[n] for n in ("serial", "fused_wait", "step", "naive")), steps=(4,),
                  preview_interval=2, concurrency=(1, 8), per_client=2, repeats=1),
    "slo": dict(systems=tuple(M[n] for n in ("serial", "step", "step_srpt", "step_deadline")), steps=(2, 4, 8),
                preview_interval=2, requests=12, repeats=1),
    "priority": dict(requests=10, background=4),
    "step-cache": dict(per_client=2, repeats=2),
    "edits": dict(per_client=4),
    "think": dict(per_client=2, repeats=1, max_new_tokens=12),
}


def select(names: Optional[list[str]] = None, quick: bool = False) -> list[Scenario]:
    """The scenarios to run, in table order: the named ones (all, or QUICK's), at QUICK's size if `quick`."""
    chosen = names or list(QUICK if quick else SCENARIOS)
    unknown = [n for n in chosen if n not in SCENARIOS]
    if unknown:
        raise SystemExit(f"unknown scenario(s) {', '.join(unknown)}; known: {', '.join(SCENARIOS)}")
    return [replace(SCENARIOS[n], **QUICK.get(n, {})) if quick else SCENARIOS[n] for n in chosen]


def on_device(scenario: Scenario, device: str, dtype: str, preset: Optional[str]) -> Scenario:
    """The scenario with every engine system on `device` in `dtype`, and `preset` where it uses the bench one."""
    systems = tuple(replace(s, parameters={**s.parameters, "device": device, **(
        {"dtype": dtype} if "dtype" in s.parameters else {})}) for s in scenario.systems)
    return replace(scenario, systems=systems,
                   preset=preset if preset and scenario.preset == "bench" else scenario.preset)
