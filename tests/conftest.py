"""Shared fixtures: a small LAION-style dataset of real photographs, and a runner for the entry points."""

import base64
import gzip
import io
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _without_torch_in_subprocesses() -> None:
    """The processes the tests start (entry points, scripts, launchers) run with USE_TORCH=0 unless the test's
    env says otherwise: ppdiffusers then does not import PyTorch (a test extra here, not a dependency of the
    trainer) at start-up, 2 of the 6 seconds every process spends importing, about as users without torch
    run. Their PyTorch checkpoints (.bin, .ckpt) still load: ppdiffusers reads them without torch. The
    FLUX.2 PyTorch side (.venv-flux2, diffusers needs torch) is left alone, and so is this process."""
    original = subprocess.Popen.__init__

    def popen(self, args, *positional, **options):
        program = str(args[0] if isinstance(args, (list, tuple)) else args)
        env = options.get("env")
        if ".venv-flux2" not in program and (env is None or "USE_TORCH" not in env):
            options["env"] = {**(os.environ if env is None else env), "USE_TORCH": "0"}
        original(self, args, *positional, **options)

    subprocess.Popen.__init__ = popen


@pytest.fixture(scope="session", autouse=True)
def _subprocesses_without_torch():
    # A fixture, not an import-time patch: under pytest-xdist the controller starts the worker processes
    # with Popen, and they must keep torch (the PyTorch-side tests run in them).
    _without_torch_in_subprocesses()


# The files that run multi-process training jobs under the launcher, heaviest first: `make test` runs the suite
# on two pytest-xdist workers (--dist loadfile), which share out files in collection order, so these start first
# and the many short files fill in around them.
HEAVY_FILES = ("test_preemption.py", "test_architectures.py", "test_dc_ae.py", "test_wan.py", "test_rae.py",
               "test_ltx2_hunyuanvideo15.py",
               "test_stall.py", "test_rank_failure.py", "test_train_e2e.py", "test_multinode.py", "test_alignment.py",
               "test_crash_safety.py", "test_disk.py", "test_untrained_kept.py")


def pytest_collection_modifyitems(items) -> None:
    rank = {name: k for k, name in enumerate(HEAVY_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(HEAVY_FILES)))


# Set by `make test` (and so by CI): the test extras (requirements-test.txt) must be there, so a failed
# install fails the tests that need them instead of skipping them silently.
REQUIRE_TEST_EXTRAS = "VAE_TRAINER_REQUIRE_TEST_EXTRAS"


def import_test_extra(module: str, reason: str):
    """`module` (a test-only dependency such as torch or diffusers): skipped when it is missing, except
    under `make test` / CI (VAE_TRAINER_REQUIRE_TEST_EXTRAS=1), where a missing extra is an error."""
    if os.environ.get(REQUIRE_TEST_EXTRAS) == "1":
        import importlib

        try:
            return importlib.import_module(module)
        except ImportError as error:
            raise ImportError(f"{module} is missing but {REQUIRE_TEST_EXTRAS}=1 (make test): {reason}") from error
    return pytest.importorskip(module, reason=reason)


def _photos():
    import skimage.data

    return [skimage.data.astronaut(), skimage.data.chelsea(), skimage.data.coffee(), skimage.data.rocket()]


@pytest.fixture(scope="session")
def photo_filelist(tmp_path_factory) -> str:
    """A .filelist.list over 4 gzip parts of 48 random JPEG crops of real photos."""
    root = tmp_path_factory.mktemp("photos")
    rng = np.random.default_rng(0)
    photos, lines = _photos(), []
    for k in range(48):
        photo = photos[k % len(photos)]
        size = int(rng.integers(64, 128))
        y, x = rng.integers(0, photo.shape[0] - size), rng.integers(0, photo.shape[1] - size)
        buffer = io.BytesIO()
        Image.fromarray(photo[y : y + size, x : x + size]).save(buffer, "JPEG", quality=90)
        lines.append(f"crop {k}\t-\t{base64.b64encode(buffer.getvalue()).decode()}\n")
    for part in range(4):
        with gzip.open(root / f"part-{part:05d}.gz", "wt") as f:
            f.writelines(lines[part::4])
    (root / "train.filelist").write_text("".join(f"part-{p:05d}.gz\n" for p in range(4)))
    (root / "train.filelist.list").write_text("train.filelist 1.0\n")
    return str(root / "train.filelist.list")


@pytest.fixture(scope="session")
def held_out_folder(tmp_path_factory) -> str:
    """A folder of 6 PNG tiles of photos that photo_filelist never uses."""
    import skimage.data

    root = tmp_path_factory.mktemp("held_out")
    photos = [np.asarray(Image.open(os.path.join(os.path.dirname(skimage.data.__file__), name)).convert("RGB"))
              for name in ("motorcycle_left.png", "hubble_deep_field.jpg")]
    for k, photo in enumerate(photos):
        for j in range(3):
            Image.fromarray(photo[j * 96 : j * 96 + 96, 100:196]).save(root / f"tile_{k}_{j}.png")
    return str(root)


@pytest.fixture(scope="session")
def held_out_32(tmp_path_factory) -> str:
    """6 held-out 32x32 PNG crops of photos, so that the evaluation's resize and crop leave them as they are."""
    import skimage.data

    root = tmp_path_factory.mktemp("held_out_32")
    for k, photo in enumerate((skimage.data.coffee(), skimage.data.rocket())):
        for j in range(3):
            Image.fromarray(photo[40 + 32 * j: 72 + 32 * j, 100:132]).save(root / f"crop_{k}_{j}.png")
    return str(root)


def write_tar(path, members):
    """A tar file of (name, bytes) members, in order (a WebDataset shard when names share keys)."""
    import tarfile

    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def load_script(name: str):
    """scripts/<name>.py as a module, to call its main() in-process."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "scripts", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_entry_point(script: str, args, nproc: int = 1, log_dir=None, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run train_vae_(no_)trainer.py as a user would, optionally under paddle.distributed.launch on CPU."""
    env = {**os.environ, "PYTHONPATH": REPO}
    command = [sys.executable]
    if nproc > 1:
        command += ["-m", "paddle.distributed.launch", "--nproc_per_node", str(nproc), "--log_dir", str(log_dir)]
    command += [os.path.join(REPO, script), *map(str, args)]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        logs = ""
        if log_dir is not None and os.path.isdir(log_dir):
            for name in sorted(os.listdir(log_dir)):
                logs += f"\n--- {name}\n" + open(os.path.join(log_dir, name)).read()[-4000:]
        raise AssertionError(f"{script} failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}{logs}")
    return result


def run_each_driver(tmp_path_factory, make_args) -> dict:
    """{driver: output dir} of one run of each entry point (in this process) with the flags make_args(output_dir)
    returns."""
    out = {}
    for driver in DRIVERS:
        output_dir = str(tmp_path_factory.mktemp(driver.split(".")[0]))
        run_in_process(driver, make_args(output_dir))
        out[driver] = output_dir
    return out


def read_scalars(logdir: str, tag: str) -> dict:
    """{step: value} of one VisualDL scalar tag."""
    from visualdl import LogReader

    files = [f for f in os.listdir(logdir) if f.startswith("vdlrecords")]
    assert len(files) == 1, files
    reader = LogReader(file_path=os.path.join(logdir, files[0]))
    return {record.id: record.value for record in reader.get_data("scalar", tag)}


DRIVERS = ["train_vae_trainer.py", "train_vae_no_trainer.py"]


def run_in_process(driver: str, argv) -> None:
    """main() of an entry point in this process (so tests can count calls or patch functions, and skip the seconds
    a new interpreter spends importing Paddle and ppdiffusers). Paddle names each layer's weights from a counter
    (conv2d_98.w_0), and checkpoints key the optimizer's state by those names: as in a new process, the run's count
    starts at 0, so that a run resumes another run's checkpoint as a user's next process would."""
    import importlib

    from paddle.utils import unique_name

    with unique_name.guard():
        importlib.import_module(driver[: -len(".py")]).main([str(a) for a in argv])


def EVAL_FLAGS(folder):
    """Evaluation during training on a held-out folder every 2 steps."""
    return {"eval_file_list": folder, "eval_steps": 2, "eval_num_images": 6, "metric_for_best_model": "psnr"}


def tiny_args(file_list, output_dir, **overrides):
    """Command-line flags for a few steps of the micro VAE at 32 px on CPU (with the GAN from step 3)."""
    args = {
        "file_list": file_list, "vae_config_file": "configs/vae_micro.json", "output_dir": output_dir,
        "resolution": 32, "per_device_train_batch_size": 2, "max_steps": 4, "disc_start": 2,
        "logging_steps": 1, "save_steps": 2, "image_logging_steps": 2, "seed": 7, "device": "cpu",
        "dataloader_num_workers": 0, "disc_base_channels": 8, "learning_rate": 1e-3, "disable_tqdm": "true",
        "use_ema": "true", "ema_decay": 0.9,
    }
    args.update(overrides)
    if str(args.get("use_ema")).lower() == "false" and "ema_decay" not in overrides:
        del args["ema_decay"]  # refused without the EMA (it would do nothing)
    return [item for key, value in args.items() for item in (f"--{key}", value)]


def assert_same_tensor(a, b, name: str) -> None:
    """Same shape and values (np.testing compares 0-d arrays wrongly once ppdiffusers has set np.bool = bool)."""
    assert np.shape(a) == np.shape(b), (name, np.shape(a), np.shape(b))
    np.testing.assert_array_equal(np.atleast_1d(a), np.atleast_1d(b), err_msg=name)


# For a TrainingEvaluator without build_networks: build.Networks' fields it reads, those of a plain VAE's run (no
# --input_size, no --posterior_std, a family whose latent statistics are of the evaluation images, no VF model, no
# teacher).
PLAIN_NETWORKS = SimpleNamespace(vf_model=None, teacher=None, model=SimpleNamespace(
    input_size=None, posterior_std=0.0, family=SimpleNamespace(normalisation=SimpleNamespace(on_training_data=False))))


def vae_weights(output_dir, folder="vae"):
    from ppdiffusers import AutoencoderKL

    vae = AutoencoderKL.from_pretrained(os.path.join(output_dir, folder))
    return {k: v.numpy() for k, v in vae.state_dict().items()}


def enabled_scaler(scale=1024.0, min_loss_scale=1.0):
    """A LossScaler in the state its constructor leaves it in on a GPU (on CPU it disables itself).

    Its `scale()` multiplies only once an fp16 autocast has run; on CPU use `pretend_fp16_autocast()`."""
    from collections import defaultdict

    import paddle
    from paddle.amp.grad_scaler import _refresh_optimizer_state

    from vae_trainer.precision import LossScaler

    scaler = LossScaler(init_loss_scaling=scale, min_loss_scale=min_loss_scale)
    scaler._enable, scaler._use_dynamic_loss_scaling = True, True
    scaler._incr_ratio, scaler._decr_ratio = 2.0, 0.5
    scaler._incr_every_n_steps, scaler._decr_every_n_nan_or_inf = 2, 1
    scaler._incr_count = scaler._decr_count = 0
    scaler._scale, scaler.scale_value = paddle.to_tensor(np.array([scale], np.float32)), float(scale)
    scaler._cache_found_inf = None
    for name in ("_found_inf", "_temp_found_inf_value_false", "_temp_found_inf_fp16", "_temp_found_inf_bf16",
                 "_temp_found_inf_fp32"):
        setattr(scaler, name, paddle.to_tensor(np.array([0]).astype(np.bool_)))
    scaler._optimizer_states = defaultdict(_refresh_optimizer_state)
    return scaler


def pretend_fp16_autocast() -> str:
    """Make Paddle believe an fp16 autocast has run (GradScaler.scale() checks it); returns the previous dtype."""
    from paddle.amp.auto_cast import amp_global_state

    previous = amp_global_state().amp_dtype
    amp_global_state().amp_dtype = "float16"
    return previous
