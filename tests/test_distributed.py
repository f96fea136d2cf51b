"""The cross-rank weight check (distributed.assert_parameters_in_sync) must catch drift, not just agree.

Two real processes (paddle.distributed.launch on CPU, gloo) build the same layer; then one rank's weights
are changed in ways training drift could produce, and every rank must raise naming the parameter.
"""

import json
import subprocess
import sys
import textwrap

import numpy as np
import paddle
import pytest
from conftest import REPO

from vae_trainer.distributed import FINGERPRINT_SIZE, parameter_fingerprint

WORKER = textwrap.dedent(
    """
    import json, sys
    import paddle
    sys.path.insert(0, sys.argv[1])
    from vae_trainer.distributed import assert_parameters_in_sync, init_distributed, rank

    paddle.set_device("cpu")
    init_distributed()

    def layer():
        paddle.seed(0)  # identical weights on both ranks
        return paddle.nn.Sequential(paddle.nn.Linear(6, 5), paddle.nn.Linear(5, 4))

    def perturbed(kind):
        model = layer()
        if rank() == 1:
            weight = model[1].weight  # named "1.weight"
            values = weight.numpy()
            if kind == "nudge":  # one element, by one float32 step
                values[2, 3] = values[2, 3] + abs(values[2, 3]) * 2.0 ** -23
            elif kind == "swap":  # same sum and absolute sum
                values[0, 0], values[3, 1] = values[3, 1], values[0, 0]
            weight.set_value(values)
        return model

    results = {}
    for kind in ("none", "nudge", "swap"):
        try:
            fingerprint = assert_parameters_in_sync(perturbed(kind))
            results[kind] = {"raised": None, "size": int(fingerprint.size)}
        except RuntimeError as error:
            results[kind] = {"raised": str(error)}
    from vae_trainer.distributed import average_over_ranks

    a, b = paddle.full([2, 3], float(4 * rank() + 1)), paddle.to_tensor([float(rank()), 10.0 + 3 * rank()])
    average_over_ranks([a, b])  # two shapes, one collective
    results["average"] = [a.numpy().tolist(), b.numpy().tolist()]
    print("RESULT " + json.dumps(results))
    from vae_trainer.distributed import run_and_exit
    run_and_exit(lambda: None)  # ends as the entry points do (no SIGABRT at exit)
    """
)


def test_a_perturbed_rank_is_caught_on_every_rank(tmp_path):
    (tmp_path / "worker.py").write_text(WORKER)
    completed = subprocess.run(
        [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2", "--log_dir",
         str(tmp_path / "log"), str(tmp_path / "worker.py"), REPO],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    for rank in (0, 1):
        log = (tmp_path / "log" / f"workerlog.{rank}").read_text()
        results = json.loads(log.split("RESULT ", 1)[1].splitlines()[0])
        assert results["none"] == {"raised": None, "size": 4 * FINGERPRINT_SIZE}  # 2 weights + 2 biases
        assert results["average"] == [[[3.0] * 3] * 2, [0.5, 11.5]]  # (1 + 5) / 2; (0 + 1) / 2, (10 + 13) / 2
        for kind in ("nudge", "swap"):
            message = results[kind]["raised"]
            assert message is not None, f"rank {rank}: {kind} not detected"
            assert "parameters differ between rank" in message and "1.weight" in message, message


def test_fingerprint_sees_each_trainable_parameter_and_nothing_frozen():
    paddle.seed(0)
    model = paddle.nn.Sequential(paddle.nn.Linear(3, 2), paddle.nn.BatchNorm1D(2))
    fingerprint = parameter_fingerprint(model)
    assert fingerprint.shape == (4 * FINGERPRINT_SIZE,)  # BatchNorm's running statistics are not parameters
    weight = model[0].weight.numpy().astype(np.float64)
    positions = (np.arange(weight.size) * 0.6180339887498949) % 1.0
    np.testing.assert_allclose(fingerprint[:3], [weight.sum(), np.abs(weight).sum(), (weight.ravel() * positions).sum()],
                               rtol=1e-12)
    model[0].weight.stop_gradient = True
    assert parameter_fingerprint(model).shape == (3 * FINGERPRINT_SIZE,)
    for p in model.parameters():
        p.stop_gradient = True
    with pytest.raises(ValueError, match="no trainable parameters"):
        parameter_fingerprint(model)  # an empty fingerprint would let any two ranks "agree"


# ---- all_ranks_agree / from_rank_0 (issue 29, items 2 and 3): in-process, this process as rank 1 of 2 with a
# simulated rank 0 (its outcome of the block, and the value it decides). Two real processes: tests/test_rank_failure.py.
@pytest.fixture
def as_rank_1(monkeypatch):
    """Set `.failure` to rank 0's (error class, one-line reason) and `.value` to what rank 0 broadcasts."""
    import paddle.distributed as dist
    from types import SimpleNamespace

    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "2")
    monkeypatch.setenv("PADDLE_TRAINER_ID", "1")
    rank_0 = SimpleNamespace(failure=None, value=None, collectives=0)

    def all_reduce(tensor, *args, **kwargs):
        rank_0.collectives += 1
        tensor.set_value(tensor + int(rank_0.failure is not None))

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(dist, "all_gather_object", lambda out, obj, *a, **k: out.extend([rank_0.failure, obj]))
    monkeypatch.setattr(dist, "broadcast_object_list", lambda objects, src, *a, **k: objects.__setitem__(0, rank_0.value))
    return rank_0


def test_one_process_raises_the_original_exception_or_its_explanation():
    from vae_trainer.disk import OutOfSpace
    from vae_trainer.distributed import all_ranks_agree

    original = KeyError("k")
    with pytest.raises(KeyError) as raised:
        with all_ranks_agree("saving"):
            raise original
    assert raised.value is original
    with pytest.raises(OutOfSpace, match="^full$") as raised:
        with all_ranks_agree("saving", explain=lambda error: OutOfSpace("full")):
            raise OSError(28, "No space left on device")
    assert isinstance(raised.value.__cause__, OSError)
    with all_ranks_agree("saving", explain=lambda error: 1 / 0):  # success: nothing explained
        pass


def test_a_failure_on_another_rank_raises_here_with_its_rank_reason_and_kind(as_rank_1, caplog):
    from vae_trainer.disk import OutOfSpace
    from vae_trainer.distributed import all_ranks_agree

    with all_ranks_agree("saving checkpoint-2"):  # every rank succeeded: one collective, nothing raised
        pass
    assert as_rank_1.collectives == 1
    as_rank_1.failure = (OutOfSpace, "writing checkpoint-4 failed: No space left on device (ENOSPC)")
    with pytest.raises(OutOfSpace) as raised:  # a user error: still one `error:` line on this rank
        with all_ranks_agree("saving checkpoint-4"):
            pass
    assert "rank 0" in str(raised.value) and "No space left on device" in str(raised.value)
    assert "\n" not in str(raised.value) and str(raised.value) in caplog.text  # logged at once, too


def test_this_ranks_failure_is_named_one_line_chained_and_a_bug_stays_a_bug(as_rank_1):
    from vae_trainer.distributed import all_ranks_agree

    original = TypeError("checkpoint\nsecond line")
    with pytest.raises(RuntimeError) as raised:
        with all_ranks_agree("exporting"):
            raise original
    message = str(raised.value)
    assert "rank 1" in message and "TypeError" in message and "checkpoint" in message
    assert "second line" not in message and "rank 0" not in message
    assert raised.value.__cause__ is original
    as_rank_1.failure = (FileNotFoundError, "same reason")
    with pytest.raises(FileNotFoundError, match="ranks 0, 1: same reason"):
        with all_ranks_agree("resuming"):
            raise FileNotFoundError("same reason")


def test_lpips_at_evaluation_is_rank_0s_decision(as_rank_1, tmp_path, monkeypatch):
    from types import SimpleNamespace

    from vae_trainer import build

    monkeypatch.setattr(build, "TrainingEvaluator", lambda data_args, args, networks, lpips, inception: lpips)
    networks = SimpleNamespace(lpips=None, lpips_weights=str(tmp_path / "only_on_rank_0.pdparams"))
    data_args = SimpleNamespace(inception_weights=None)
    as_rank_1.value = True  # rank 0 has the weights, this rank does not: refused, naming this rank
    with pytest.raises(Exception, match="failed on rank 1") as raised:
        build.build_evaluator(data_args, None, networks)
    assert "only_on_rank_0.pdparams" in str(raised.value)
    (tmp_path / "only_on_rank_0.pdparams").write_text("")  # rank 0 has none: nobody loads LPIPS
    as_rank_1.value = False
    assert build.build_evaluator(data_args, None, networks) is None


def test_a_resume_path_or_output_dir_one_rank_cannot_see_is_refused_naming_it(as_rank_1, tmp_path):
    from vae_trainer import checkpoint as ckpt
    from vae_trainer.output_dir import check_shared

    with pytest.raises(FileNotFoundError, match="failed on rank 1: .*checkpoint-3"):
        ckpt.resolve_resume(str(tmp_path), str(tmp_path / "checkpoint-3"))
    as_rank_1.value = "token-rank-0-wrote"  # into its own, node-local folder
    with pytest.raises(ValueError, match="failed on rank 1: .*not shared") as raised:
        check_shared(str(tmp_path / "out"))
    assert "shared file system" in str(raised.value)
