# meshrun developer commands. Every target installs what it needs itself.
PY      ?= python3
VENV    ?= .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed

.PHONY: install test demo bench lint clean compat

install: $(STAMP)

# torch is pinned here (the package metadata allows a range): a bare `torch` would pull a
# multi-GB CUDA build. numpy beside it, or every `import torch` warns.
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install --quiet --upgrade pip
	$(VPY) -m pip install --quiet torch==2.13.0 numpy
	$(VPY) -m pip install --quiet -e '.[test]' torch==2.13.0  # pinned again: never re-resolved
	touch $(STAMP)

test: install
	$(VPY) -m pytest -q -n 2 --dist loadfile --durations=30 tests

# A fresh checkpoint directory each time, so the demo trains from step 0 (a restart within the
# run resumes from it).
demo: install
	rm -rf checkpoints/demo
	$(VENV)/bin/meshrun --nproc-per-node 2 --max-restarts 1 examples/train_char_lm.py --steps 300 --checkpoint-dir checkpoints/demo

bench: install
	$(VPY) benchmarks/launch.py

lint: install
	$(VENV)/bin/ruff check meshrun tests benchmarks examples

# The suite's core against another torch: `make compat TORCH=2.14.1` (not in CI). A venv of its
# own per version; the core: every strategy's parity tests, checkpoints, the launch contract,
# hangs, multi-node c10d, torchrun's options. PIP_CONSTRAINT=/dev/null lifts a local cap.
COMPAT_TESTS := tests/parallel/test_ddp.py tests/parallel/test_fsdp.py tests/parallel/test_tp.py \
	tests/parallel/test_pp.py tests/parallel/test_checkpoint.py tests/agent/test_launch.py \
	tests/agent/test_hang.py tests/rendezvous/test_c10d_agents.py \
	tests/launcher/test_torchrun_parity.py tests/test_torch_door.py tests/test_private_torch.py
compat:
	@test -n "$(TORCH)" || { echo "give TORCH=<version>, e.g. make compat TORCH=2.14.1"; exit 2; }
	$(PY) -m venv .venv-torch$(TORCH)
	.venv-torch$(TORCH)/bin/python -m pip install --quiet torch==$(TORCH) numpy
	.venv-torch$(TORCH)/bin/python -m pip install --quiet -e '.[test]' torch==$(TORCH)
	.venv-torch$(TORCH)/bin/python -m pytest -q -p no:cacheprovider $(COMPAT_TESTS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
