"""Dataflow offload: data augmentation and validation on the DPU's cores.

``augment`` is the one augmentation pipeline (local and offloaded paths share it), ``service`` and
``validation`` are the two servers, ``protocol`` frames their TCP stream, ``models`` is the model
family the validation side can rebuild. The host side is host_lib.offload."""
