"""``dosa demo``: train a small real model with DDP twice, gradients reduced by dosa at ~1% density
and by Gloo's dense allreduce, and compare accuracy, time per step and bytes on the wire.

Two ways to run the ranks (``backend``):

* ``testbed``: a namespace testbed (``testbed.Testbed``: hosts, DPUs with the XDP dataplane, control
  plane and DPU workers) is brought up, the training runs through ``Testbed.run`` (torchrun's
  environment plus DOSA_*), and the testbed is torn down afterwards. Needs root.
* ``loopback``: no privilege; DPU workers in userspace mode (same protocol, the worker merges
  itself) on 127.0.0.1 and the ranks as local processes with torchrun's environment. Used by the tests
  and when the testbed cannot run here.

Both runs happen in ONE launch of ``examples.train_digits --comm dosa,dense`` (torch imports once
per rank; same data split, same seed, same initial weights). Everything started is stopped in a
``finally`` (also on Ctrl-C): DPU workers, ranks, the testbed.

``--offload`` adds a second launch (``dosa.app.demo.offload_rank``) on the same cluster: the augmentation and
validation services (dpu_fw/offload) run on every DPU -- inside its namespace on the testbed, on
127.0.0.1 on loopback -- pinned to the DPU half of the CPUs (the testbed comes up with
``--cpu-split``; on loopback the ranks are pinned to the host half the same way). Every rank trains
on its own shard, once augmenting it itself and validating on rank 0 (``host``), once reading it
from its DPU's augmentation service and submitting snapshots to the validation service
(``offload``); the summary compares their time per epoch and checks that both trained identically.

By job: ``config`` (DemoConfig, the backend choice), ``clusters`` (loopback and testbed; the ranks
go through testbed.runner, the one rank launcher), ``run`` (run_demo), ``report`` (summaries, plot,
table), ``offload`` (the --offload comparison) and ``offload_rank`` (its rank side).
"""
from .clusters import LoopbackCluster, TestbedCluster, free_port, stop_processes
from .config import BACKENDS, DemoConfig
from .report import format_report
from .run import run_demo

__all__ = ["BACKENDS", "DemoConfig", "LoopbackCluster", "TestbedCluster", "format_report", "free_port",
           "run_demo", "stop_processes"]
