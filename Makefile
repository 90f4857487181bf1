# The two commands a newcomer needs: `make demo` (run the tiny GRPO job locally) and
# `make test` (every ring: lint, unit, integration, e2e against a real API server).
# Both install what they need; caches live outside the repo (~/.cache/grpo-operator).
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
TINY := examples/.tiny
# `make demo ENGINE=vllm`: the same job on vLLM's CPU build (.venv-vllm, built here first), with a
# tiny model whose heads vLLM's CPU attention takes (head_dim 32).
ENGINE ?= torch

.PHONY: setup vllm-venv control-plane lint test test-quick test-unit demo crd podspec-schema cluster-up cluster-down e2e-kind

setup:
	bash hack/venv.sh >/dev/null

# vLLM's CPU build in a venv of its own (.venv-vllm): the integration ring runs our vllm engine on it.
vllm-venv:
	bash hack/vllm-venv.sh >/dev/null

control-plane:
	bash hack/build-control-plane.sh
	bash hack/third-party-crds.sh >/dev/null
	bash hack/lws.sh build

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports --no-cache

test: setup vllm-venv control-plane lint
	bash hack/test.sh

# The edit loop (a few minutes): lint, the unit ring but its slow tests, one real scenario of the
# integration ring (a local job end to end) and one of the e2e ring (a p5 job on the API server).
QUICK := tests/integration/test_local_runtime.py::test_runs_to_completion_with_summary_plot_and_no_leftovers \
	tests/e2e/test_operator.py::test_p5_job_gets_children_efa_pods_and_runs
test-quick: setup control-plane lint
	$(PY) -m pytest -q -m "not slow" tests/unit
	$(PY) -m pytest -q $(QUICK)

test-unit: setup
	$(PY) -m pytest tests/unit

ifeq ($(TASK),calculator)
# Multi-turn tool use: the tiny model learns to call the calculator (examples/tiny-local-calculator.yaml).
demo: setup
	$(VENV)/bin/grpo-operator tiny-model examples/.tiny-calculator --task calculator
	rm -rf out/demo-calculator
	$(VENV)/bin/grpo-operator run examples/tiny-local-calculator.yaml --workdir out/demo-calculator \
		--summary-json out/demo-calculator/summary.json
else ifeq ($(ENGINE),vllm)
demo: setup vllm-venv
	$(VENV)/bin/grpo-operator tiny-model $(TINY)-vllm --head-dim 32
	rm -rf out/demo-vllm  # a fresh run each time: its checkpoints would otherwise resume the last one
	$(VENV)/bin/grpo-operator run examples/tiny-local-vllm.yaml --workdir out/demo-vllm \
		--summary-json out/demo-vllm/summary.json
else
demo: setup
	$(VENV)/bin/grpo-operator tiny-model $(TINY)
	rm -rf out/demo  # a fresh run each time: its checkpoints would otherwise resume the last one
	$(VENV)/bin/grpo-operator run examples/tiny-local.yaml --workdir out/demo --summary-json out/demo/summary.json
endif

crd: setup
	$(VENV)/bin/grpo-operator crd > crds/grpojobs.grpo.dev.yaml
	cp crds/grpojobs.grpo.dev.yaml charts/grpo-operator/crds/grpojobs.grpo.dev.yaml

# After a Kubernetes bump (hack/versions.sh): re-resolve the embedded PodSpec schema, then `make crd`.
podspec-schema:
	bash hack/podspec-schema.sh

cluster-up: setup control-plane
	bash hack/cluster.sh up

cluster-down:
	bash hack/cluster.sh down

# For users with Docker: the same e2e ring against a kind cluster with faked GPU/EFA capacity.
e2e-kind: setup
	eval "$$(bash hack/kind.sh up)" && $(PY) -m pytest tests/e2e
