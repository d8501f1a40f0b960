"""dosa DPU firmware: workers on the DPU's cores (result emission, shadow copies, userspace merge)
and the data-offload services (augmentation, validation)."""
