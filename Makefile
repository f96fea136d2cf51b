# Two commands on a fresh machine:  `make demo` (train a small VAE on CPU)  and  `make test`.
# `make setup` is the idempotent part both use: virtualenv with pinned packages, LPIPS weights, demo data.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip --disable-pip-version-check -q
STAMP  := $(VENV)/.installed
DEMO_OUT ?= outputs/demo
# The Paddle wheel: CPU by default; e.g. PADDLE=paddlepaddle-gpu==3.3.1 (with PIP_EXTRA_INDEX_URL set to
# Paddle's package index for your CUDA version) on a GPU machine.
PADDLE ?= paddlepaddle==3.3.1

TEST_STAMP := $(VENV)/.test-installed

.PHONY: setup demo test clean-demo

setup: $(STAMP) weights/lpips_vgg16.pdparams data/demo/.done

$(STAMP): requirements.txt constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install "$(PADDLE)" -r requirements.txt -c constraints.txt
	touch $(STAMP)

# Test-only: pytest, torch + pytorch-fid (FID InceptionV3 port) and diffusers (PyTorch interop); see requirements-test.txt.
$(TEST_STAMP): $(STAMP) requirements-test.txt
	$(PIP) install -r requirements-test.txt -c constraints.txt
	$(PIP) install --no-deps pytorch-fid==0.3.0
	touch $(TEST_STAMP)

weights/lpips_vgg16.pdparams: $(STAMP) scripts/convert_lpips_weights.py
	$(BIN)/python scripts/convert_lpips_weights.py --output $@

data/demo/.done: $(STAMP) scripts/prepare_demo_data.py scripts/make_parts.py scripts/write_filelist.py
	$(BIN)/python scripts/prepare_demo_data.py --output_dir data/demo
	touch $@

demo: setup
	bash scripts/run_demo.sh $(DEMO_OUT)

test: setup $(TEST_STAMP)
	$(BIN)/python -m pytest -q tests

clean-demo:
	rm -rf $(DEMO_OUT)
