"""The scripts/run_*.sh launchers, on CPU with a tiny model (they default to SD at 256 px on GPUs)."""

import os
import subprocess

import pytest
from conftest import REPO


@pytest.mark.parametrize("script,env", [
    ("run_single_trainer.sh", {}),
    ("run_multi_no_trainer.sh", {"NPROC": "2"}),
])
def test_run_script_trains_on_cpu(photo_filelist, tmp_path, script, env):
    env = {**os.environ, "DEVICE": "cpu", "FILE_LIST": photo_filelist, "VAE_CONFIG": "configs/vae_micro.json",
           "OUTPUT_DIR": str(tmp_path / "out"), "RESOLUTION": "32", "BATCH_SIZE": "2", "MAX_STEPS": "2", **env}
    result = subprocess.run(["bash", f"scripts/{script}", "--disc_base_channels", "8", "--dataloader_num_workers", "0",
                             "--disable_tqdm", "true"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert os.path.isfile(tmp_path / "out" / "vae" / "config.json")
    if "NPROC" in env:
        assert {"workerlog.0", "workerlog.1"} <= set(os.listdir(tmp_path / "out" / "launch_logs"))
