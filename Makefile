# The project's commands. `make demo` and `make test` are the two a newcomer needs.
PY := .venv/bin/python
export PATH := $(CURDIR)/.venv/bin:$(PATH)
# The models `make serve` and `make demo` load: names of model_repository/ separated by commas
# (`make serve MODELS=flux,ltx2`), or `all`; empty: qwen_image alone. Also read from the environment.
MODELS ?=

.PHONY: setup models repository serve demo test mutants bench bench-quick bench-lora bench-sizes bench-packing bench-priority bench-slo bench-own bench-efficiency bench-video bench-scheduling clean

setup:  ## create .venv with the pinned packages and a working perf_analyzer (idempotent)
	@bash scripts/setup.sh

models: setup  ## build the tiny random-weight pipelines offline into models/
	@$(PY) -m engine_lib.tiny_models --pipeline all --preset tiny

repository: setup  ## regenerate model_repository/<pipeline> input/output lists and docs tables from the adapters
	@$(PY) -m engine_lib.serving.repository

serve: models  ## run tritonserver on the local model repository with the MODELS models (Ctrl-C stops it)
	@MODELS='$(MODELS)' $(PY) -m engine_lib.serving.launcher serve

demo: models  ## start the server with the MODELS models, generate one image with the client, stop the server
	@MODELS='$(MODELS)' $(PY) scripts/demo.py

test: models  ## unit, engine, pipeline and real-tritonserver tests
	@$(PY) -m pytest -q $(PYTEST_ARGS)

mutants: models  ## plant each bug of tests/mutants/ and check the tests catch it (about 20 min; MUTANTS_ARGS: options of tests/mutants/run.py)
	@$(PY) tests/mutants/run.py $(MUTANTS_ARGS)

bench: models  ## the full benchmark (about 20 min): writes benchmarks/results and docs/benchmarks.md
	@$(PY) -m benchmarks.run $(BENCH_ARGS)

bench-quick: models  ## the quick benchmark (under 5 min)
	@$(PY) -m benchmarks.run --quick $(BENCH_ARGS)

bench-lora: models  ## mixed vs LoRA-homogeneous step batching side by side (about 2 min)
	@$(PY) -m benchmarks.lora

bench-sizes: models  ## mixed image sizes: fused waves vs step batching with and without mixed_size_batching (about 10 minutes)
	@$(PY) -m benchmarks.mixed_sizes

bench-packing: models  ## one forward over rows of two and of eight sizes: packed vs per size vs padded, per pipeline (2 minutes)
	@$(PY) -m benchmarks.packing

bench-priority: models  ## an urgent request alone and under a full background load, side by side (a few minutes)
	@$(PY) -m benchmarks.priority

bench-slo: models  ## the Poisson mixed-steps load with SLOs sent as deadlines: shortest remaining vs deadline order (5 minutes)
	@$(PY) -m benchmarks.slo

bench-own: models  ## our own model code (BAGEL, HunyuanImage-3.0): step batching at concurrency 4 vs serial (a minute)
	@$(PY) -m benchmarks.own_models

bench-efficiency: models  ## served and in-process engine vs the offline batched limit, per-phase split (about 5 min)
	@$(PY) -m benchmarks.efficiency

bench-scheduling: models  ## issue #13's scheduling targets with the engine in-process, no tritonserver (benchmarks/device.sh: on the lent GPU)
	@$(PY) -m benchmarks.scheduling

bench-video: models  ## LTX-2 serial vs fused vs step (frames/s), Helios first chunk vs final (a few minutes)
	@$(PY) -m benchmarks.video

clean:
	rm -rf models out build .pytest_cache
