"""The test helpers themselves: a missing test extra fails under `make test` instead of skipping silently, and
the PyTorch helper saves a diffusers folder in a process where nothing else imported safetensors.torch."""

import os
import subprocess
import sys

import pytest
from conftest import REPO, REQUIRE_TEST_EXTRAS, import_test_extra


def test_a_missing_test_extra_skips_for_a_developer_but_fails_under_make_test(monkeypatch):
    monkeypatch.delenv(REQUIRE_TEST_EXTRAS, raising=False)
    with pytest.raises(pytest.skip.Exception):
        import_test_extra("no_such_test_extra_module", reason="test")
    monkeypatch.setenv(REQUIRE_TEST_EXTRAS, "1")
    with pytest.raises(ImportError, match="no_such_test_extra_module"):
        import_test_extra("no_such_test_extra_module", reason="test")
    assert import_test_extra("json", reason="test").dumps([]) == "[]"


def test_make_test_requires_the_test_extras():
    with open(os.path.join(REPO, "Makefile")) as handle:
        recipe = handle.read().split("\ntest:", 1)[1].split("\n\n", 1)[0]
    assert f"{REQUIRE_TEST_EXTRAS}=1" in recipe and "pytest" in recipe


def test_the_torch_helper_saves_a_diffusers_folder_without_ppdiffusers_imported_first(tmp_path):
    import_test_extra("diffusers", reason="PyTorch diffusers is a test dependency (requirements-test.txt)")
    script = ("import sys; from torch_vae import make_torch_vae; make_torch_vae().save_pretrained(sys.argv[1]); "
              "assert 'ppdiffusers' not in sys.modules")
    completed = subprocess.run([sys.executable, "-c", script, str(tmp_path)], cwd=os.path.join(REPO, "tests"),
                               env={**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.path.join(REPO, "tests")]),
                                    "USE_TORCH": "1"},  # (PyTorch diffusers; conftest turns torch off otherwise)
                               capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert "diffusion_pytorch_model.safetensors" in os.listdir(tmp_path)
