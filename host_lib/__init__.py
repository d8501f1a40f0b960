"""dosa host library: what runs on each training host (compress, quantize, the aggregation client,
PyTorch hook). The wire encoder (``dosa.packetizer``) and the UDP endpoint (``dosa.transport``) are
in the bottom layer, shared with the DPU worker."""
