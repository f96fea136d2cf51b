# Two commands on a fresh machine:  `make demo` (train a small VAE on CPU)  and  `make test`.
# `make setup` is the idempotent part both use: virtualenv with pinned packages, LPIPS weights, demo data.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip --disable-pip-version-check -q
STAMP  := $(VENV)/.installed
DEMO_OUT ?= outputs/demo

.PHONY: setup demo test clean-demo

setup: $(STAMP) weights/lpips_vgg16.pdparams data/demo/.done

$(STAMP): requirements.txt constraints.txt requirements-test.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install -r requirements.txt -r requirements-test.txt -c constraints.txt
	touch $(STAMP)

weights/lpips_vgg16.pdparams: $(STAMP) scripts/convert_lpips_weights.py
	$(BIN)/python scripts/convert_lpips_weights.py --output $@

data/demo/.done: $(STAMP) scripts/prepare_demo_data.py scripts/make_parts.py scripts/write_filelist.py
	$(BIN)/python scripts/prepare_demo_data.py --output_dir data/demo
	touch $@

demo: setup
	bash scripts/run_demo.sh $(DEMO_OUT)

test: setup
	$(BIN)/python -m pytest -q tests

clean-demo:
	rm -rf $(DEMO_OUT)
