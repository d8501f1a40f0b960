"""dosa: DPU-offloaded in-network sparse gradient aggregation.

The modules directly in this package are the bottom layer every component imports and that imports
none of them (docs/layers.md): the wire format (``wire``), the job schema (``job``), the rank's
DOSA_* environment (``env``), address tables and the multicast rule (``net``), the wire encoder and
decoder (``packetizer``), the UDP endpoint (``transport``, on the Cython batching of ``_net``), the
join API's client (``join``), errors, the scapy layer and the capture tools. The application on top
of everything (the ``dosa`` command, the command registrations that belong to no one component,
the demo) is the subpackage ``dosa.app``; ``__main__`` only calls its ``main``."""
__version__ = "0.1.0"
