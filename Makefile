# Everything a fresh machine needs, behind the README's two commands:
#   make serve   — install, then start Triton with the bundled tiny model pair on the CPU
#   make test    — install, then run the whole test suite (CI runs this via .ci/run)
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: install serve test test-fast tiny-models clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	scripts/install.sh $(VENV) serve,test,bench
	touch $@

serve: install
	$(VENV)/bin/nightdraft serve

test: install
	$(PY) -m pytest -q -ra $(PYTEST_ARGS)

test-fast: install
	$(PY) -m pytest -q -ra -m "not slow" $(PYTEST_ARGS)

tiny-models: install
	$(PY) scripts/make_tiny_models.py --out models

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
