"""Dataflow offload, the DPU side: the two servers on the DPU's cores, ``service`` (augmentation)
and ``validation``, on ``_server``'s accept loop. What host and DPU share (the augmentation
pipeline, the TCP framing, datasets, the model family, the evaluation) is host_lib.offload's,
one layer below, so the host side never imports this package."""
