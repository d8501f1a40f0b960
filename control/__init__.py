"""dosa control plane: attaches the dataplane, installs jobs and flows, admits workers, counters.

``control.Controller`` drives one DPU's dataplane instance (control/controller.py); the join API
hosts call is control/api/ (split by job: see its __init__); ``dosa ctl`` is control/cli.py. See docs/control.md."""
from .alloc import AdmissionError

__all__ = ["AdmissionError", "Controller"]


def __getattr__(name):
    """``control.Controller`` is imported on first use: the controller drives BPF, and importing
    the package (``dosa ctl`` asking a remote control plane, the join API in userspace mode) must
    not need it."""
    if name == "Controller":
        from .controller import Controller

        return Controller
    raise AttributeError(f"module 'control' has no attribute {name!r}")
