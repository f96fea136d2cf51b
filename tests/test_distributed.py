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
