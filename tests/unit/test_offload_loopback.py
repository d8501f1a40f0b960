"""The offload services as real subprocesses on loopback: offloaded batches equal local batches,
a dying service gives a clear error or an exact fallback, validation metrics equal local ones."""
from __future__ import annotations

import os
import socket
import warnings

import numpy as np
import pytest

from dosa.offload.augment import AugmentConfig, make_pipeline
from dosa.offload.models import build_model, state_arrays
from dosa.offload.evaluate import evaluate_snapshot
from host_lib.offload import (OffloadedLoader, OffloadedValidator, OffloadFallbackWarning,
                              OffloadServices, ServiceLost, ServiceRefused)

DS = "digits:size=16,channels=2"
BIG = "digits:size=64,channels=3"  # 3 MB batches: more than the socket buffers can hide
CPU = str(max(os.sched_getaffinity(0)))


@pytest.fixture(scope="module")
def services():
    with OffloadServices(cpus=CPU, datasets=[DS]) as svc:
        yield svc


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _assert_same(batches, pipe, epoch):
    assert len(batches) == len(pipe)
    for b, (x, y, ids) in enumerate(batches):
        lx, ly, lids = pipe.batch(epoch, b)
        assert np.array_equal(x, lx) and np.array_equal(y, ly) and np.array_equal(ids, lids), b


@pytest.mark.timeout(120)
def test_offloaded_batches_equal_local_batches_bit_for_bit(services):
    cfg = AugmentConfig(crop_padding=3, noise_std=0.1)
    loader = OffloadedLoader(services.augment_address, dataset=DS, batch_size=48, seed=11,
                             augment=cfg, as_numpy=True, return_ids=True)
    pipe = make_pipeline(DS, "train", 48, 11, cfg)
    first = list(loader)  # epoch 0, then the next pass is epoch 1 by itself
    _assert_same(first, pipe, 0)
    _assert_same(list(loader), pipe, 1)
    loader.set_epoch(7)
    _assert_same(list(loader), pipe, 7)
    assert loader.remote_batches == 3 * len(pipe) and loader.local_batches == 0


@pytest.mark.timeout(120)
def test_loader_yields_torch_tensors_like_a_dataloader(services):
    import torch
    loader = OffloadedLoader(services.augment_address, dataset=DS, batch_size=100, seed=0)
    x, y = next(iter(loader))
    assert isinstance(x, torch.Tensor) and x.dtype == torch.float32 and tuple(x.shape) == (100, 2, 16, 16)
    assert y.dtype == torch.int64 and len(loader) == -(-1438 // 100)


@pytest.mark.timeout(120)
def test_service_pins_itself_to_the_requested_cpus(services):
    for proc in services.procs.values():
        assert os.sched_getaffinity(proc.pid) == {int(CPU)}


@pytest.mark.timeout(120)
def test_bad_request_is_refused_with_the_service_reason(services):
    loader = OffloadedLoader(services.augment_address, dataset="digits:size=3", fallback=True)
    with pytest.raises(ServiceRefused, match="size=3"):
        len(loader)


@pytest.mark.timeout(60)
def test_unreachable_service_is_a_clear_error_or_a_local_fallback():
    address = f"127.0.0.1:{_free_port()}"
    with pytest.raises(ServiceLost, match="unreachable"):
        len(OffloadedLoader(address, dataset=DS, timeout=2))
    loader = OffloadedLoader(address, dataset=DS, batch_size=64, seed=2, fallback=True, timeout=2,
                             as_numpy=True, return_ids=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = list(loader)
    assert sum(issubclass(w.category, OffloadFallbackWarning) for w in caught) == 1
    _assert_same(got, make_pipeline(DS, "train", 64, 2, AugmentConfig()), 0)


def _kill_after(svc, loader, k):
    """Consume k batches, SIGKILL the service, then consume the rest of the epoch."""
    it = iter(loader)
    got = [next(it) for _ in range(k)]
    svc.kill("augment")
    got.extend(it)
    return got


@pytest.mark.timeout(180)
def test_killed_service_midepoch_falls_back_with_every_batch_exactly_once():
    with OffloadServices(cpus=CPU, datasets=[BIG], prefetch=1, validate=False) as svc:
        loader = OffloadedLoader(svc.augment_address, dataset=BIG, batch_size=64, seed=5,
                                 fallback=True, as_numpy=True, return_ids=True)
        loader.set_epoch(2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = _kill_after(svc, loader, 3)
    assert sum(issubclass(w.category, OffloadFallbackWarning) for w in caught) == 1
    assert loader.remote_batches >= 3 and loader.local_batches > 0  # the switch happened mid-epoch
    ids = np.concatenate([b[2] for b in got])
    assert np.array_equal(np.sort(ids), np.arange(len(ids))) and len(ids) == 1438
    _assert_same(got, make_pipeline(BIG, "train", 64, 5, AugmentConfig()), 2)


@pytest.mark.timeout(180)
def test_killed_service_midepoch_without_fallback_raises_after_exact_batches():
    with OffloadServices(cpus=CPU, datasets=[BIG], prefetch=1, validate=False) as svc:
        loader = OffloadedLoader(svc.augment_address, dataset=BIG, batch_size=64, seed=5,
                                 as_numpy=True, return_ids=True)
        got = []
        with pytest.raises(ServiceLost, match="failed at batch") as err:
            it = iter(loader)
            got = [next(it) for _ in range(3)]
            svc.kill("augment")
            for batch in it:
                got.append(batch)
    index = int(str(err.value).split("failed at batch ")[1].split()[0])
    assert index == len(got) < len(loader)  # it names the first batch it could not deliver
    pipe = make_pipeline(BIG, "train", 64, 5, AugmentConfig())
    for b, (x, _, ids) in enumerate(got):
        assert np.array_equal(ids, pipe.batch(0, b)[2]) and np.array_equal(x, pipe.batch(0, b)[0])


@pytest.fixture(scope="module")
def trained():
    """A small CNN trained for a few steps (so its metrics are not those of a constant)."""
    import torch
    torch.manual_seed(0)
    model = build_model({"family": "cnn", "in_shape": [2, 16, 16], "classes": 10, "channels": [8]})
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for x, y, _ in make_pipeline(DS, "train", 64, 0, AugmentConfig()).iter_epoch(0):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        opt.step()
    return model


def _copy(model):
    import copy
    return copy.deepcopy(model)


@pytest.mark.timeout(120)
def test_validation_metrics_equal_local_evaluation_of_the_same_snapshot(services, trained):
    model = _copy(trained)
    snapshot = state_arrays(model)
    with OffloadedValidator(services.validate_address, dataset=DS) as validator:
        handle = validator.submit(model, epoch=0)
        with __import__("torch").no_grad():  # training goes on: the snapshot must not see this
            for p in model.parameters():
                p.add_(1.0)
        remote = handle.result(timeout=60)
    local = evaluate_snapshot(model.spec, snapshot, DS)
    assert remote["accuracy"] > 0.3  # a trained model, not a constant
    assert (remote["loss"], remote["accuracy"], remote["samples"]) == \
        (local["loss"], local["accuracy"], local["samples"])


@pytest.mark.timeout(120)
def test_validator_on_a_dead_service_raises_or_evaluates_locally(trained):
    model = trained
    address = f"127.0.0.1:{_free_port()}"
    with pytest.raises(ServiceLost):
        OffloadedValidator(address, dataset=DS, timeout=2).submit(model, 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with OffloadedValidator(address, dataset=DS, timeout=2, fallback=True) as v:
            handles = [v.submit(model, 0), v.submit(model, 1)]
            results = [h.result(60) for h in handles]
    assert sum(issubclass(w.category, OffloadFallbackWarning) for w in caught) == 1
    local = evaluate_snapshot(model.spec, state_arrays(model), DS)
    assert all(r == local for r in results) and all(h.local for h in handles)


@pytest.mark.timeout(120)
def test_a_snapshot_that_does_not_fit_its_spec_fails_that_job_only(services, trained):
    model = trained
    wrong = dict(model.spec, channels=[4])
    with OffloadedValidator(services.validate_address, dataset=DS) as validator:
        bad = validator.submit(model, epoch=0, spec=wrong)
        good = validator.submit(model, epoch=1)
        with pytest.raises(ServiceRefused, match="shape"):
            bad.result(timeout=60)
        assert good.result(timeout=60)["samples"] == 359


@pytest.mark.timeout(120)
def test_services_stop_when_the_host_process_dies_without_stopping_them():
    import subprocess
    import sys
    import time
    script = ("import os\nfrom host_lib.offload import OffloadServices\n"
              f"svc = OffloadServices(datasets=[{DS!r}], validate=False).start()\n"
              "print(svc.procs['augment'].pid, flush=True)\nos._exit(0)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=90,
                         check=True, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    pid = int(out.stdout.split()[0])

    def gone() -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # exited, not yet reaped
        except FileNotFoundError:
            return True

    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and not gone():
        time.sleep(0.1)
    stopped = gone()
    if not stopped:
        os.kill(pid, 9)  # do not leave it behind, then fail
    assert stopped, "the service outlived the host process that started it"
