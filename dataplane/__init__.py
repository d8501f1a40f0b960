"""dosa dataplane: the XDP programs (C, compiled by BCC at load time) and their loader helpers."""
