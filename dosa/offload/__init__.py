"""What the dataflow offload's host side (host_lib.offload) and DPU side (dpu_fw.offload) share, in
the bottom layer so neither imports the other: ``augment`` (the one augmentation pipeline),
``protocol`` (framing of the TCP stream), ``datasets``, ``models`` (the model family the validation
side rebuilds; torch is imported only when a model is built) and ``evaluate`` (the one evaluation).
See docs/offload.md."""
