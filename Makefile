# Two entry points that work on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch first, pinned: a loose requirement would pull a multi-GB CUDA build. Override on GPU machines, e.g.
# `make install TORCH_SPEC=torch`.
TORCH_SPEC ?= torch==2.13.0
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: install redis demo test lint bench clean

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e '.[gpu,hf,flower,dev]'
	touch $@

install: $(VENV)/.installed

redis:
	@command -v redis-server >/dev/null 2>&1 || { $(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq redis-server >/dev/null; }

demo: install redis
	$(BIN)/eagle3q demo

test: install redis
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -p no:cacheprovider

bench: install redis
	cd bench && ../$(BIN)/python run_all.py

clean:
	rm -rf var .pytest_cache
