"""dosa testbed: hosts, DPUs and a fabric in network namespaces on one machine; deployment."""
