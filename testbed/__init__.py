"""dosa testbed: hosts, DPUs and a fabric in network namespaces on one machine; deployment.

``testbed.Testbed`` is the Python API (docs/testbed.md); ``dosa testbed ...`` the CLI."""
__all__ = ["Testbed", "RankFailure", "RunResult"]


def __getattr__(name):
    """The API is imported on first use: ``dosa deploy`` and the CLI's argument parsing import this
    package, and must not need pyroute2 (the namespaces' netlink) for that."""
    if name == "Testbed":
        from testbed.core import Testbed

        return Testbed
    if name in ("RankFailure", "RunResult"):
        from testbed import runner

        return getattr(runner, name)
    raise AttributeError(f"module 'testbed' has no attribute {name!r}")
