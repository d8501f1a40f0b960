"""Dataflow offload, the DPU side: the two servers on the DPU's cores, ``service`` (augmentation)
and ``validation``, on ``_server``'s accept loop. What host and DPU share (the augmentation
pipeline, the TCP framing, datasets, the model family, the evaluation) is dosa.offload's, in the
bottom layer, so neither side imports the other's package."""
