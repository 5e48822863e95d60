# The project's commands. `make demo` and `make test` are the two a newcomer needs.
PY := .venv/bin/python
export PATH := $(CURDIR)/.venv/bin:$(PATH)
# The models `make serve` and `make demo` load: names of model_repository/ separated by commas
# (`make serve MODELS=flux,ltx2`), or `all`; empty: qwen_image alone. Also read from the environment.
MODELS ?=

.PHONY: setup models repository serve demo test mutants bench bench-quick clean

setup:  ## create .venv with the pinned packages and a working perf_analyzer (idempotent)
	@bash scripts/setup.sh

models: setup models/.built  ## build the tiny random-weight pipelines offline into models/

# What the tiny builds depend on: when none of it changed since models/.built and every model
# folder is there, `make models` (so `make demo`, `make serve`) starts without the check, which
# imports torch and every pipeline. A missing model folder counts as a change (empty rules below).
TINY_SOURCES := requirements.txt $(shell find engine_lib/pipelines -type f -not -path '*/__pycache__/*')
TINY_MODELS := $(patsubst model_repository/%/config.pbtxt,models/%-tiny/tiny_model.json,$(wildcard model_repository/*/config.pbtxt)) models/loras
$(TINY_MODELS):

models/.built: $(TINY_SOURCES) $(TINY_MODELS) | setup
	@$(PY) -m engine_lib.pipelines.tiny_models --pipeline all --preset tiny
	@touch $@

repository: setup  ## regenerate model_repository/<pipeline> input/output lists and docs tables from the adapters
	@$(PY) -m engine_lib.serving.repository

serve: models  ## run tritonserver on the local model repository with the MODELS models (Ctrl-C stops it)
	@MODELS='$(MODELS)' $(PY) -m engine_lib.serving.serve serve

demo: models  ## start the server with the MODELS models, generate one image with the client, stop the server
	@MODELS='$(MODELS)' $(PY) scripts/demo.py

test: models  ## unit, engine, pipeline and real-tritonserver tests
	@$(PY) -m pytest -q $(PYTEST_ARGS)

mutants: models  ## plant each bug of tests/mutants/ and check the tests catch it (about 20 min; MUTANTS_ARGS: options of tests/mutants/run.py)
	@$(PY) tests/mutants/run.py $(MUTANTS_ARGS)

bench: models  ## every scenario of benchmarks/scenarios.py, or one: make bench SCENARIO=<name> (results: benchmarks/results/)
	@$(PY) -m benchmarks.run $(if $(SCENARIO),--scenario $(SCENARIO)) $(BENCH_ARGS)

bench-quick: models  ## a few scenarios with fewer requests and repeats, or SCENARIO=<name> (results: benchmarks/results/quick/)
	@$(PY) -m benchmarks.run --quick $(if $(SCENARIO),--scenario $(SCENARIO)) $(BENCH_ARGS)

clean:
	rm -rf models out build .pytest_cache
