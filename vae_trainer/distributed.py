"""Ranks: the process group, the gradient all-reduce (no `paddle.DataParallel`, docs/launching.md), how ranks
agree (one rank's failure ends every rank with its reason), the weights' cross-rank check, `run_and_exit`.

Also stopping on a scheduler's signal with a checkpoint of the step reached (docs/reliability.md, "Preemption"):
a signal only notes a stop request; after the step (`loop.Run.after_step`) the driver saves and raises `Preempted`."""

import atexit
import contextlib
import logging
import os
import signal
import sys
import threading
import traceback
from typing import Any, Callable, Iterable, Iterator, List, NoReturn, Optional

import numpy as np
import paddle
import paddle.distributed as dist
from paddle.distributed.fleet.utils.hybrid_parallel_util import fused_allreduce_gradients

from .user_errors import USER_ERROR_TYPES, UserError

logger = logging.getLogger("vae_trainer")
PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL of sysexits.h: "try again later" (resume with --resume_from_checkpoint latest)
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
_received: Optional[str] = None  # the first stop signal since `install_stop_handlers`


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("PADDLE_TRAINERS_NUM", "1"))


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("PADDLE_TRAINER_ID", "0"))


def init_distributed() -> None:
    """Join the process group when launched with several processes (idempotent)."""
    if world_size() > 1 and not dist.is_initialized():
        dist.init_parallel_env()


@contextlib.contextmanager
def all_ranks_agree(what: str, explain: Optional[Callable[[Exception], Exception]] = None) -> Iterator[None]:
    """Run a block on every rank; it succeeds on all or raises on all "`what` failed on rank R: reason" (a barrier),
    of the lowest failing rank's class if a user error, else RuntimeError. `explain` maps this rank's exception."""
    error: Optional[Exception] = None
    try:
        yield
    except Exception as caught:  # noqa: BLE001 (every rank must learn of any failure)
        error = caught
    failed = error is not None
    if world_size() > 1:
        failed = bool(sum_over_ranks(paddle.to_tensor([int(failed)], dtype="int64")).item())
    if not failed:
        return
    cause = error
    if error is not None and explain is not None:
        with contextlib.suppress(Exception):  # (explaining must not keep this rank from the gather below)
            error = explain(error)
    if world_size() == 1:
        raise error if error is cause else error from cause
    user = isinstance(error, (UserError,) + USER_ERROR_TYPES)
    reason = None if error is None else " ".join(str(error).split()) if user else \
        f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"
    gathered: list = []
    dist.all_gather_object(gathered, None if error is None else (type(error) if user else RuntimeError, reason))
    ranks: dict = {}
    for r, item in enumerate(gathered):
        if item is not None:
            ranks.setdefault(item[1], []).append(str(r))
    message = f"{what} failed on " + "; ".join(
        f"rank{'s' * (len(rs) > 1)} {', '.join(rs)}: {reason}" for reason, rs in ranks.items())
    logger.error("%s", message)  # in every rank's log at once, even if the launcher ends this rank next
    kind = next(item[0] for item in gathered if item is not None)
    try:
        raised = kind(message)
    except TypeError:  # a user error class that takes more than a message (json.JSONDecodeError)
        raised = UserError(message)
    raise raised from error


def from_rank_0(value: Any) -> Any:
    """Rank 0's `value` on every rank (a decision taken once)."""
    shared = [value]
    if world_size() > 1:
        dist.broadcast_object_list(shared, src=0)
    return shared[0]


class Preempted(Exception):
    """A driver stopped on a signal after saving a checkpoint (exit PREEMPTED_EXIT_CODE)."""


def install_stop_handlers(single_process: bool) -> None:
    """Handle SIGNALS from now on (main thread only, Python's rule; elsewhere nothing is installed)."""
    global _received
    _received = None

    def handle(signum: int, frame) -> None:
        global _received
        if _received is None:
            _received = signal.Signals(signum).name
            logger.warning("%s received: finishing the step in flight, then saving a checkpoint and stopping "
                           "(a second Ctrl-C in a single process quits at once)", _received)
        elif signum == signal.SIGINT and single_process:
            raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread():
        for signum in SIGNALS:
            signal.signal(signum, handle)


def stop_signal() -> Optional[str]:
    """The name of the stop signal this process received, None if none (or no handlers are installed)."""
    return _received


def run_and_exit(main: Callable[[], None], stop_signals: bool = False) -> NoReturn:
    """Run an entry point's `main` and end the process in one order on every path (docs/reliability.md); with
    `stop_signals`, SIGTERM / SIGINT / SIGUSR1 are stop requests. Several processes end with `os._exit`."""
    status = 0
    if stop_signals:
        install_stop_handlers(single_process=world_size() == 1)
    try:
        main()
    except SystemExit as stop:  # the status Python would give it
        if stop.code is not None and not isinstance(stop.code, int):
            print(stop.code, file=sys.stderr)  # a message: printed, status 1
        status = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
    except Preempted as stopped:  # saved where it stopped: a message, not a traceback
        print(f"stopped: {stopped}", file=sys.stderr)
        status = PREEMPTED_EXIT_CODE
    except BaseException as error:  # noqa: B902 (every exit path ends below)
        traceback.print_exc()
        status = 130 if isinstance(error, KeyboardInterrupt) else 1
    several, signalled = dist.is_initialized(), stop_signal() is not None
    try:
        if several and status == 0:  # (the barrier)
            signalled = bool(sum_over_ranks(paddle.to_tensor([float(signalled)])).item())
        if status == 0 and signalled:
            print(f"stopped: {stop_signal() or 'a signal to another rank'} arrived during the final save "
                  f"or export, which finished; exit code {PREEMPTED_EXIT_CODE} (--resume_from_checkpoint "
                  "latest finds nothing left to train)", file=sys.stderr)
            status = PREEMPTED_EXIT_CODE
        if several:
            dist.destroy_process_group()  # (Python's group registry; the C++ store lives until os._exit)
    except BaseException:  # noqa: B902 (a failed barrier must still end below, not in the exit handlers)
        traceback.print_exc()
        status = status or 1
    if not several:
        sys.exit(status)
    atexit._run_exitfuncs()  # what interpreter shutdown would run before the C++ destructors
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def sync_gradients(parameters: Iterable[paddle.Tensor], fill_missing: bool = False) -> None:
    """Average the gradients of `parameters` over all ranks. `fill_missing` (clips: a one-frame pass leaves Wan's
    time_convs none; unequal buffers): zeros where another rank has one (a collective and a read; AdamW skips none)."""
    if world_size() > 1:
        trained = [p for p in parameters if not p.stop_gradient]
        if fill_missing:
            anywhere = sum_over_ranks(paddle.to_tensor([int(p.grad is not None) for p in trained], "int32")).numpy()
            trained = [p for p, n in zip(trained, anywhere) if n]
            for p in (p for p in trained if p.grad is None):
                p.grad = paddle.zeros_like(p)
        fused_allreduce_gradients(trained, None)


def sum_over_ranks(value: paddle.Tensor) -> paddle.Tensor:
    """`value` summed over all ranks, staying on the device (no host read)."""
    if world_size() > 1:
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value


def average_over_ranks(tensors: List[paddle.Tensor]) -> None:
    """Set each of `tensors` to its mean over the ranks, in one collective."""
    if world_size() > 1 and tensors:
        flat = sum_over_ranks(paddle.concat([tensor.reshape([-1]) for tensor in tensors])) / world_size()
        for tensor, part in zip(tensors, paddle.split(flat, [int(tensor.numel()) for tensor in tensors])):
            tensor.set_value(part.reshape(tensor.shape))


def broadcast_parameters(layer: paddle.nn.Layer) -> None:
    """Make every rank start from rank 0's weights and buffers."""
    if world_size() > 1:
        for tensor in list(layer.parameters()) + list(layer.buffers()):
            dist.broadcast(tensor, src=0)


FINGERPRINT_SIZE = 3  # numbers per parameter


def parameter_fingerprint(layer: paddle.nn.Layer) -> np.ndarray:
    """Per trainable parameter (not BatchNorm statistics): sum, absolute sum, and a sum weighted by frac(i * golden
    ratio) that permuted values change too."""
    values = []
    with paddle.no_grad():
        for p in [p for p in layer.parameters() if not p.stop_gradient]:
            flat = p.astype("float64").flatten()
            position_weights = (paddle.arange(flat.shape[0], dtype="float64") * 0.6180339887498949) % 1.0
            values.append(paddle.stack([flat.sum(), flat.abs().sum(), (flat * position_weights).sum()]))
    if not values:
        raise ValueError("parameter_fingerprint: the layer has no trainable parameters")
    return paddle.stack(values).numpy().reshape(-1)


def assert_parameters_in_sync(layer: paddle.nn.Layer) -> np.ndarray:
    """Raise if any parameter differs across ranks (drift is never silent); return this rank's fingerprint."""
    fingerprint = parameter_fingerprint(layer)
    if world_size() > 1:
        gathered = []
        dist.all_gather(gathered, paddle.to_tensor(fingerprint))
        names = [n for n, p in layer.named_parameters() if not p.stop_gradient]
        for other_rank, other in enumerate(gathered):
            differs = np.nonzero(other.numpy() != fingerprint)[0]
            if differs.size:
                bad = sorted({names[i // FINGERPRINT_SIZE] for i in differs})[:5]
                raise RuntimeError(f"parameters differ between rank {rank()} and rank {other_rank}: {bad} ...")
    return fingerprint
