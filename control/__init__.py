"""dosa control plane: attaches the dataplane, installs jobs and flows, admits workers, counters.

``control.Controller`` drives one DPU's dataplane instance (control/controller.py); the join API
hosts call is control/api/ (split by job: see its __init__); ``dosa ctl`` is control/cli.py. See docs/control.md."""
from .alloc import AdmissionError
from .controller import Controller

__all__ = ["AdmissionError", "Controller"]
