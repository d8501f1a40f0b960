"""Exceptions shared by every component. A DosaError's message is one sentence a user can act on;
the CLI prints it without a traceback and exits non-zero."""


class DosaError(Exception):
    """Base class of every error dosa reports to a user."""


class NeedsRoot(DosaError):
    def __init__(self, what: str):
        super().__init__(f"{what} needs root (BPF and network namespaces); run it with sudo or as root")
