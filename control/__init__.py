"""dosa control plane: attaches the dataplane, installs jobs and flows, admits workers, counters."""
