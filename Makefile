# Two commands on a fresh machine:  `make demo` (train a small VAE on CPU)  and  `make test`.
# `make setup` is the idempotent part both use: virtualenv with pinned packages, LPIPS weights, demo data.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip --disable-pip-version-check -q
DEMO_OUT ?= outputs/demo
CLIP_DEMO_OUT ?= outputs/demo_clips
# The Paddle wheel, one pip requirement: CPU by default; on a GPU machine e.g. PADDLE=paddlepaddle-gpu==3.3.1
# (with PIP_EXTRA_INDEX_URL set to Paddle's package index for your CUDA version), or a wheel's URL or path.
# One stamp per requirement, named by its checksum (a URL's ':' and '/' cannot be in a make target), so
# that `make setup PADDLE=...` switches an existing .venv to another wheel, and `make setup` back to the CPU one.
PADDLE ?= paddlepaddle==3.3.1
STAMP  := $(VENV)/.installed-paddle-$(firstword $(shell printf '%s' '$(PADDLE)' | cksum))
# Both wheels provide the `paddle` module: the one not asked for (both, for a URL or path) is uninstalled first.
OTHER_PADDLE := $(filter-out $(firstword $(subst ==, ,$(PADDLE))),paddlepaddle paddlepaddle-gpu)

TEST_STAMP := $(VENV)/.test-installed

.PHONY: setup demo demo-clips test clean-demo

setup: $(STAMP) weights/lpips_vgg16.pdparams data/demo/.done

$(STAMP): requirements.txt constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	rm -f $(VENV)/.installed $(VENV)/.installed-*
	$(PIP) uninstall -y $(OTHER_PADDLE)
	$(PIP) install "$(PADDLE)" -r requirements.txt -c constraints.txt
	printf '%s\n' '$(PADDLE)' > $(STAMP)

# Test-only: pytest, torch + pytorch-fid (FID InceptionV3 port) and diffusers (PyTorch interop); see requirements-test.txt.
$(TEST_STAMP): $(STAMP) requirements-test.txt
	$(PIP) install -r requirements-test.txt -c constraints.txt
	$(PIP) install --no-deps pytorch-fid==0.3.0
	touch $(TEST_STAMP)

# Test-only, a virtualenv of its own: diffusers 0.42.1 (AutoencoderKLFlux2, the FLUX.2 / ERNIE-Image VAE) cannot
# share .venv with paddlenlp's huggingface_hub pin; see requirements-flux2-test.txt.
FLUX2_VENV  := .venv-flux2
FLUX2_STAMP := $(FLUX2_VENV)/.installed

$(FLUX2_STAMP): requirements-flux2-test.txt
	test -x $(FLUX2_VENV)/bin/python || $(PYTHON) -m venv $(FLUX2_VENV)
	$(FLUX2_VENV)/bin/python -m pip --disable-pip-version-check -q install -r requirements-flux2-test.txt
	touch $(FLUX2_STAMP)

# Order-only on the environment: switching the Paddle wheel does not redo the weights or the demo data.
weights/lpips_vgg16.pdparams: scripts/convert_lpips_weights.py | $(STAMP)
	$(BIN)/python scripts/convert_lpips_weights.py --output $@

data/demo/.done: scripts/prepare_demo_data.py scripts/make_parts.py scripts/write_filelist.py | $(STAMP)
	$(BIN)/python scripts/prepare_demo_data.py --output_dir data/demo
	touch $@

demo: setup
	bash scripts/run_demo.sh $(DEMO_OUT)

# Fine-tune a video VAE's decoder on clips made from the demo photos (docs/fine-tuning.md, "Fine-tuning on clips").
demo-clips: setup
	bash scripts/run_clip_demo.sh $(CLIP_DEMO_OUT)

# VAE_TRAINER_REQUIRE_TEST_EXTRAS: a test extra that failed to install fails its tests instead of skipping them.
# TEST_WORKERS pytest-xdist processes share the test files out (one file stays on one worker); 0 runs them in this process.
TEST_WORKERS ?= 2
test: setup $(TEST_STAMP) $(FLUX2_STAMP)
	VAE_TRAINER_REQUIRE_TEST_EXTRAS=1 $(BIN)/python -m pytest -q tests -n $(TEST_WORKERS) --dist loadfile

clean-demo:
	rm -rf $(DEMO_OUT) $(CLIP_DEMO_OUT)
