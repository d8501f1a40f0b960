"""The offload services in a DPU namespace, reached by a host namespace over a veth: the same
bit-identical batches and validation metrics as on loopback, across a real link."""
from __future__ import annotations

import os

import numpy as np
from veth_pair import veth_pair
import pytest

pytestmark = [pytest.mark.root, pytest.mark.timeout(180)]

HOST_IP, DPU_IP = "10.78.0.1", "10.78.0.2"
DS = "digits:size=16,channels=2"


def lab():
    return veth_pair("do", HOST_IP, DPU_IP)


def test_services_in_a_dpu_namespace_serve_a_host_namespace_exactly():
    import torch
    from control.netns import run_in_netns
    from dosa.offload.augment import AugmentConfig, make_pipeline
    from dosa.offload.models import build_model, state_arrays
    from dosa.offload.evaluate import evaluate_snapshot
    from host_lib.offload import OffloadedLoader, OffloadedValidator, OffloadServices

    cpu = str(max(os.sched_getaffinity(0)))
    with lab() as (h, d), OffloadServices(host=DPU_IP, netns=d, cpus=cpu, datasets=[DS]) as svc:
        assert svc.augment_address.startswith(DPU_IP + ":")
        loader = OffloadedLoader(svc.augment_address, dataset=DS, batch_size=64, seed=4,
                                 as_numpy=True, return_ids=True, timeout=20)
        epochs = run_in_netns(h, lambda: [list(loader), list(loader)])  # sockets made in h
        loader.close()
        pipe = make_pipeline(DS, "train", 64, 4, AugmentConfig())
        for e, batches in enumerate(epochs):
            assert len(batches) == len(pipe)
            for b, (x, y, ids) in enumerate(batches):
                lx, ly, lids = pipe.batch(e, b)
                assert np.array_equal(x, lx) and np.array_equal(y, ly) and np.array_equal(ids, lids)
        torch.manual_seed(1)
        model = build_model({"family": "mlp", "in_shape": [2, 16, 16], "classes": 10, "hidden": [32]})
        with OffloadedValidator(svc.validate_address, dataset=DS, timeout=20) as validator:
            handle = run_in_netns(h, validator.submit, model, 0)
            remote = handle.result(timeout=90)
        local = evaluate_snapshot(model.spec, state_arrays(model), DS)
        assert (remote["loss"], remote["accuracy"]) == (local["loss"], local["accuracy"])
