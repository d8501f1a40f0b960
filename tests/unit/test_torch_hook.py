"""DosaHookState validation, the scale rule (host_lib.hook_codec), and one rank of DDP with the hook
against a real userspace DPU worker on loopback (no privilege needed); float32, fp16 and bf16 models."""
from __future__ import annotations

import copy
import gc
import json
import math
import os
import warnings

import numpy as np
import pytest

import torch
import torch.distributed as dist  # noqa: E402

from host_lib import hook_codec  # noqa: E402
from host_lib.hook_encoders import carry_over  # noqa: E402
from host_lib.torch_hook import DosaHookState, DosaUnavailableWarning, dosa_hook  # noqa: E402



# --------------------------------------------------------------------------- validation
@pytest.mark.parametrize("kw, match", [
    ({"density": 0}, "density"),
    ({"density": -0.1}, "density"),
    ({"density": 1.5}, "density"),
    ({"density": float("nan")}, "density"),
    ({"density": "0.01"}, "density"),
    ({"density": True}, "density"),
    ({"dense_warmup_steps": -1}, "dense_warmup_steps"),
    ({"dense_warmup_steps": 2.5}, "dense_warmup_steps"),
    ({"scale_exp": 63}, "scale_exp"),
    ({"scale_exp": -33}, "scale_exp"),
    ({"headroom": 0.5}, "headroom"),
    ({"headroom": float("inf")}, "headroom"),
    ({"momentum": 1.0}, "momentum"),
    ({"momentum": -0.1}, "momentum"),
    ({"client_factory": 42}, "client_factory"),
    ({"job_options": [("partition_size", 10)]}, "job_options"),
    ({"client": object()}, "allreduce_sparse"),
    ({"client": object(), "client_factory": lambda n: None}, "not both"),
])
def test_state_rejects_bad_arguments_with_a_clear_valueerror(kw, match):
    with pytest.raises(ValueError, match=match):
        DosaHookState(**kw)


def test_state_accepts_the_edges_and_starts_with_empty_statistics():
    s = DosaHookState(density=1.0, dense_warmup_steps=0, scale_exp=-32, headroom=1.0, momentum=0.0)
    assert s.density == 1.0 and s.stats.steps == 0 and s.stats.as_dict()["mean_density"] == 0.0
    s2 = DosaHookState(density=1e-4, dense_warmup_steps=5, scale_exp=62)
    assert s2.dense_warmup_steps == 5 and not s2.using_fallback


def test_a_rebuilt_bucket_layout_carries_every_parameters_residual_over():
    """DDP rebuilds buckets after step 1: parameters move between bucket indices. Their residual
    must follow them (A: 2x3, B: 4, C: 5; old buckets {0: [A, B], 1: [C]}, new {0: [C, A], 1: [B]})."""
    A, B, C = (1, (2, 3)), (2, (4,)), (3, (5,))
    old_layouts = {0: (A, B), 1: (C,)}
    old = {0: np.arange(10, dtype=np.float32), 1: np.arange(100, 105, dtype=np.float32)}
    new0 = carry_over(old_layouts, old, (C, A), 11)
    new1 = carry_over(old_layouts, old, (B,), 4)
    np.testing.assert_array_equal(new0, [100, 101, 102, 103, 104, 0, 1, 2, 3, 4, 5])
    np.testing.assert_array_equal(new1, [6, 7, 8, 9])
    D = (4, (2,))  # a parameter no old bucket had starts from zero
    np.testing.assert_array_equal(carry_over(old_layouts, old, (D, B), 6), [0, 0, 6, 7, 8, 9])


# --------------------------------------------------------------------------- codec
def test_next_scale_exp_uses_the_shared_rule_and_keeps_the_scale_on_an_empty_round():
    assert hook_codec.next_scale_exp(0.0, 4, 2.0, 17) == 17
    s = hook_codec.next_scale_exp(0.25, 4, 2.0, 17)
    c = (2**31 - 1) // 4
    assert 2.0 * 0.25 * 2.0**s <= c < 2.0 * 0.25 * 2.0**(s + 1)


# --------------------------------------------------------------------------- one rank, real worker
@pytest.fixture
def one_rank_job(tmp_path):
    """A single-worker job served by a userspace DPU worker subprocess on loopback, and a
    world-of-one Gloo process group in this process; both are torn down afterwards, also when
    setting up either fails."""
    from dosa.app.demo import free_port
    from dosa.job import JobConfig
    from userspace_dpus import userspace_dpu_workers

    model = torch.nn.Sequential(torch.nn.Linear(20, 30), torch.nn.ReLU(), torch.nn.Linear(30, 5))
    numel = sum(p.numel() for p in model.parameters())
    job = JobConfig(job_id=3, numel=numel, hosts=[("127.0.0.1", free_port())],
                    dpus=[("127.0.0.1", free_port())], scale_exp=20)
    cfg = tmp_path / "job.json"
    cfg.write_text(json.dumps(job.to_dict()))
    with userspace_dpu_workers([cfg], ready_timeout=30):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
        try:
            yield model, job, cfg
        finally:
            gc.collect()  # DDP modules of the test are freed before their group (docs/training.md)
            dist.destroy_process_group()


def _factory(cfg):
    from host_lib.client import AggregationClient
    from dosa.job import JobConfig

    return lambda numel: AggregationClient(JobConfig.load(str(cfg)), worker_id=0, timeout=10)


@pytest.mark.timeout(60)
def test_hook_at_full_density_applies_the_same_update_as_dense_ddp(one_rank_job):
    """World of one, density 1: the dosa round must give back the gradient itself (to the fixed-
    point resolution), written into every bucket, so SGD ends where plain DDP ends."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model, job, cfg = one_rank_job
    ref = DDP(copy.deepcopy(model))
    hooked = DDP(copy.deepcopy(model))
    state = DosaHookState(client_factory=_factory(cfg), density=1.0)
    hooked.register_comm_hook(state, dosa_hook)
    x, y = torch.randn(16, 20), torch.randint(0, 5, (16,))
    for m in (ref, hooked):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for _ in range(3):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(m(x), y).backward()
            opt.step()
    state.close()
    assert state.stats.dosa_rounds == 3 and state.stats.fallbacks == 0
    assert state.stats.bytes_sent > 0 and state.stats.bytes_received > 0
    # (a world of one gets a single bucket whatever bucket_cap_mb says; the multi-bucket path is
    # covered by the 4-rank test in tests/e2e/test_demo_loopback.py)
    for a, b in zip(ref.parameters(), hooked.parameters()):
        np.testing.assert_allclose(a.detach().numpy(), b.detach().numpy(), atol=1e-5)


@pytest.mark.timeout(60)
def test_connect_joins_before_the_first_step_which_then_streams(one_rank_job):
    """state.connect(numel) creates the client at once (as init_process_group would), so the first
    step needs no join and already overlaps (the streaming round) instead of parking."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model, job, cfg = one_rank_job
    made = []

    def factory(numel):
        made.append(numel)
        return _factory(cfg)(numel)

    ddp = DDP(model)
    state = DosaHookState(client_factory=factory, density=0.2)
    ddp.register_comm_hook(state, dosa_hook)
    with pytest.raises(ValueError, match="positive"):
        state.connect(0)
    state.connect(job.numel)
    assert made == [job.numel] and state.client is not None
    x, y = torch.randn(16, 20), torch.randint(0, 5, (16,))
    for _ in range(2):
        ddp.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
    state.close()
    assert made == [job.numel]  # not joined again
    assert state.stats.dosa_rounds == 2 and state.stats.overlapped_rounds == 2


@pytest.mark.timeout(60)
def test_hook_sends_about_density_and_keeps_the_rest_for_later(one_rank_job):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model, job, cfg = one_rank_job
    ddp = DDP(model)
    state = DosaHookState(client_factory=_factory(cfg), density=0.05, dense_warmup_steps=1)
    ddp.register_comm_hook(state, dosa_hook)
    x, y = torch.randn(16, 20), torch.randint(0, 5, (16,))
    for step in range(3):
        ddp.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        grads = np.concatenate([p.grad.numpy().reshape(-1) for p in ddp.parameters()])
        if step >= 1:  # after the dense warm-up step: only ~5% of the entries are non-zero
            nnz = int(np.count_nonzero(grads))
            assert 0 < nnz <= math.ceil(0.05 * job.numel)
    state.close()
    st = state.stats
    assert (st.steps, st.dense_steps, st.dosa_rounds) == (3, 1, 2)
    assert all(0 < d <= 0.05 + 1e-9 for d in st.densities)
    assert sum(np.abs(r).sum() for r in state._residuals.values()) > 0


@pytest.mark.timeout(60)
def test_unavailable_dosa_falls_back_with_one_warning_and_still_reduces(one_rank_job):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model, _, _ = one_rank_job

    def broken(numel):
        raise OSError("no route to the DPU")

    ddp = DDP(model)
    state = DosaHookState(client_factory=broken, density=0.01)
    ddp.register_comm_hook(state, dosa_hook)
    x, y = torch.randn(16, 20), torch.randint(0, 5, (16,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):
            ddp.zero_grad()
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
    ours = [w for w in caught if issubclass(w.category, DosaUnavailableWarning)]
    assert len(ours) == 1 and "no route to the DPU" in str(ours[0].message)
    assert state.using_fallback and state.stats.fallbacks == 1 and state.stats.dense_steps == 4
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in ddp.parameters())


def test_fallback_false_raises_instead(one_rank_job):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model, _, _ = one_rank_job
    ddp = DDP(model)

    def broken(numel):
        raise OSError("nope")

    ddp.register_comm_hook(DosaHookState(client_factory=broken, fallback=False), dosa_hook)
    with pytest.raises(RuntimeError, match="fallback=False"):
        torch.nn.functional.cross_entropy(ddp(torch.randn(4, 20)), torch.tensor([0, 1, 2, 3])).backward()
