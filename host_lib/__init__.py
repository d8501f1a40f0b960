"""dosa host library: what runs on each training host (compress, quantize, packetize, transport,
PyTorch hook)."""
