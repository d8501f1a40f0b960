# Two commands for a new user: `make demo` and `make test`. Each runs the set-up first (idempotent).
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup demo test test-unit clean
setup:
	@bash scripts/setup.sh

demo: setup
	$(VENV)/bin/dosa demo

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

test-unit: setup
	$(PY) -m pytest -m "not root" $(PYTEST_ARGS)

clean:
	-$(VENV)/bin/dosa testbed down 2>/dev/null
	rm -rf build *.egg-info
	find . -name '*.so' -path '*/host_lib/*' -delete; find . -name '*.so' -path '*/dpu_fw/*' -delete; find . -name '*.so' -path '*/dosa/*' -delete
