"""dosa testbed: hosts, DPUs and a fabric in network namespaces on one machine; deployment.

``testbed.Testbed`` is the Python API (docs/testbed.md); ``dosa testbed ...`` the CLI."""
from testbed.core import Testbed
from testbed.runner import RankFailure, RunResult

__all__ = ["Testbed", "RankFailure", "RunResult"]
