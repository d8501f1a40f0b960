"""dosa: DPU-offloaded in-network sparse gradient aggregation."""
__version__ = "0.1.0"
