"""Benchmarks, each printing ratios against baselines measured in the same run (``dosa bench ...``).

They sit on top of the library packages (they may import any of them; none of them imports this):
``host`` (host CPU per round), ``dataplane`` (XDP merge rate on a veth), ``allreduce`` (dosa's paths
beside Gloo baselines and the link limit), ``offload`` (augmentation/validation on the DPU's cores).
``cli`` registers the ``dosa bench`` commands.
"""
