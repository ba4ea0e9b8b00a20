# The README's two commands. Each creates .venv and installs what it needs by itself.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.tandem-installed
PKGS   := common weights master buffer explorer trainer reward
EDITABLE := $(foreach p,$(PKGS),-e packages/$(p)[test])

.PHONY: run test install clean bwrap

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

# The code reward's sandbox is bubblewrap (docs/reward.md), a Debian package, not a PyPI one:
# install it when missing, as root only (CI runs as root with apt reachable); elsewhere say how.
bwrap:
	@command -v bwrap >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  { apt-get install -y -q bubblewrap >/dev/null 2>&1 || \
	    { apt-get update -q >/dev/null && apt-get install -y -q bubblewrap >/dev/null; }; }; } || \
	  { echo "make: the code sandbox needs bubblewrap: apt-get install bubblewrap (as root)"; exit 1; }

test: $(STAMP) bwrap
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis
