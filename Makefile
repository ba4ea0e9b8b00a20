# The README's two commands. Each creates .venv and installs what it needs by itself.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.tandem-installed
PKGS   := common master buffer explorer trainer reward
EDITABLE := $(foreach p,$(PKGS),-e packages/$(p)[test])

.PHONY: run test install clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# CPU torch first, pinned: the pin is served from a local file, while an unpinned torch
# would pull the CUDA build. Everything else then sees torch satisfied.
$(STAMP): $(BIN)/python $(wildcard packages/*/pyproject.toml)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q $(EDITABLE)
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/tandem quickstart

test: $(STAMP)
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis
