"""Error classification and the repeated-error cap, as pure functions on made-up errors; the
abandonable step runner; devices and backends on a CPU machine."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

from oobleck_elastic.checkpoint import CheckpointError
from oobleck_elastic.engine.entry.devices import NCCL_ENV, backend_for, configure_nccl, resolve_device
from oobleck_elastic.records.errors import ErrorRecord, error_signature, next_error_record
from oobleck_elastic.engine.resilience.errors import JobFailed, StepAbandoned, is_communication_error
from oobleck_elastic.engine.runner import StepRunner
from oobleck_elastic.engine.trainer import LayersLost
from oobleck_elastic.rendezvous.worker import GenerationSuperseded

GLOO_CLOSED = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    "[127.0.0.1]:2971. This is typically caused by a remote worker crashing."
)
GLOO_TIMEOUT = (
    "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 4000ms for recv "
    "operation to complete"
)


@pytest.mark.parametrize(
    "err",
    [
        RuntimeError(GLOO_CLOSED),
        RuntimeError(GLOO_TIMEOUT),
        RuntimeError("[Rank 0]: Ranks 1 failed to pass monitoredBarrier in 30000 ms"),  # under DETAIL
        dist.DistBackendError("NCCL communicator was aborted"),
        dist.DistNetworkError("Connection reset"),
        dist.DistStoreError("timed out waiting for key"),
        ConnectionResetError("reset"),
        TimeoutError("socket"),
        StepAbandoned("generation 3 left out node2"),
        GenerationSuperseded("generation 3 was superseded by generation 4 while joining it"),
    ],
)
def test_communication_errors_send_a_worker_to_the_roll_call(err: BaseException) -> None:
    assert is_communication_error(err)


def _raised_from(cause: BaseException, message: str) -> RuntimeError:
    try:
        raise RuntimeError(message) from cause
    except RuntimeError as err:
        return err


STAGE_BACKWARD = "\n        Failed to run stage backward:\n        Stage output: Tensor(torch.Size([2, 32, 64]))\n"


def test_a_communication_error_under_torchs_stage_backward_is_one() -> None:
    """torch's pipeline stage re-raises a gradient hook's failed collective as its own RuntimeError
    `from` it (seen: a 1F1B job's survivor ended its worker, and with it a copy of its layers)."""
    assert not is_communication_error(RuntimeError(STAGE_BACKWARD))
    assert is_communication_error(_raised_from(RuntimeError(GLOO_CLOSED), STAGE_BACKWARD))
    assert is_communication_error(_raised_from(_raised_from(ConnectionResetError("reset"), "inner"), STAGE_BACKWARD))
    assert not is_communication_error(_raised_from(ValueError("a model bug"), STAGE_BACKWARD))
    handled = RuntimeError(STAGE_BACKWARD)
    handled.__context__ = RuntimeError(GLOO_CLOSED)  # raised while handling one, not because of it
    assert not is_communication_error(handled)


@pytest.mark.parametrize(
    "err",
    [
        RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x32 and 64x32)"),
        RuntimeError("Detected mismatch between collectives on ranks. Rank 0 is running collective: ..."),  # a bug
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        CheckpointError("checkpoint step-00000020: layer 2 file layer-002.safetensors: sha256 mismatch (timed out)"),
        LayersLost([2, 3]),
        ValueError("bad"),
        KeyError(1),
        AssertionError("bug"),
        JobFailed("closed as failed"),
        RuntimeError("plan(s) of generation(s) [3] are not available to ('node1', 0)"),
    ],
)
def test_other_errors_end_the_worker(err: BaseException) -> None:
    assert not is_communication_error(err)


def test_signature_masks_numbers_but_keeps_type_and_text() -> None:
    a = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (1.5 GiB free)")
    b = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.50 GiB (0.2 GiB free)")
    expected = "OutOfMemoryError: CUDA out of memory. Tried to allocate #.# GiB (#.# GiB free)"
    assert error_signature(a) == error_signature(b) == expected
    assert error_signature(RuntimeError("x")) != error_signature(ValueError("x"))


def test_repeated_error_counts_generations_in_a_row_at_one_step() -> None:
    err = RuntimeError("injected fault at step 3")
    r1 = next_error_record(None, err, step=3, generation=1, node="node1", local_rank=0, now=1.0)
    assert r1.count == 1 and r1.error == "RuntimeError: injected fault at step 3" and "Traceback" not in r1.traceback
    # another worker failing in the same generation counts once
    r1b = next_error_record(r1, err, step=3, generation=1, node="node2", local_rank=0, now=2.0)
    assert r1b.count == 1
    r2 = next_error_record(r1b, err, step=3, generation=2, node="node1", local_rank=0)
    r3 = next_error_record(r2, err, step=3, generation=4, node="node1", local_rank=0)
    assert (r2.count, r3.count) == (2, 3)
    # another step or another error starts again
    assert next_error_record(r3, err, step=4, generation=5, node="node1", local_rank=0).count == 1
    assert next_error_record(r3, ValueError("x"), step=3, generation=5, node="node1", local_rank=0).count == 1
    # round trip through JSON, and malformed values are ignored
    assert ErrorRecord.parse(r3.to_json()) == r3
    for bad in [
        None,
        "x",
        {**r3.to_json(), "schema_version": 99},
        {**r3.to_json(), "count": "3"},
        {k: v for k, v in r3.to_json().items() if k != "step"},
    ]:
        assert ErrorRecord.parse(bad) is None, bad


def test_runner_returns_results_and_reraises_errors_with_their_traceback() -> None:
    runner = StepRunner()
    assert runner.run(lambda: 41 + 1, should_abandon=lambda: None, interval_s=0.01) == 42

    def boom() -> None:
        raise ValueError("from the step thread")

    with pytest.raises(ValueError, match="from the step thread") as info:
        runner.run(boom, should_abandon=lambda: None, interval_s=0.01)
    assert any(tb.name == "boom" for tb in info.traceback)


def test_runner_abandons_a_blocked_step_as_soon_as_the_control_plane_says_so() -> None:
    release = threading.Event()
    asked = []

    def should_abandon() -> str | None:
        asked.append(time.monotonic())
        return "generation 2 left out lost node(s) node3" if len(asked) >= 3 else None

    t0 = time.monotonic()
    with pytest.raises(StepAbandoned, match="left out lost node"):
        StepRunner().run(release.wait, should_abandon=should_abandon, interval_s=0.02)
    assert len(asked) == 3 and time.monotonic() - t0 < 5  # not after the step (which never ends)
    release.set()


def test_devices_and_backends_on_a_cpu_machine(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto", 3) == torch.device("cpu") == resolve_device("cpu", 0)
    with pytest.raises(RuntimeError, match="training.device=cuda but CUDA is not available"):
        resolve_device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("auto", 1) == torch.device("cuda", 1)
    with pytest.raises(RuntimeError, match="LOCAL_RANK=2 has no GPU: this node has 2"):
        resolve_device("cuda", 2)
    assert backend_for(torch.device("cpu")) == "gloo"
    assert backend_for(torch.device("cuda", 0)) == "cpu:gloo,cuda:nccl"
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    values, replaced = configure_nccl(env)  # 1 tears the process down: replaced; a harmless choice is kept
    assert values == {**NCCL_ENV, "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"} == {k: env[k] for k in NCCL_ENV}
    assert replaced == ["TORCH_NCCL_ASYNC_ERROR_HANDLING=1 would end this worker when a peer fails; using 2"]
    assert configure_nccl({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"})[0]["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"
