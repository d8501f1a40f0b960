"""dosa: DPU-offloaded in-network sparse gradient aggregation.

This package is the bottom layer every component imports and that imports none of them
(docs/layers.md): the wire format (``wire``), the job schema (``job``), the rank's DOSA_*
environment (``env``), address tables and the multicast rule (``net``), the wire encoder and decoder
(``packetizer``), the UDP endpoint (``transport``, on the Cython batching of ``_net``), the join
API's client (``join``), errors, the scapy layer and the capture tools. Its entry points sit on top
of everything instead: ``cli``/``__main__`` (the ``dosa`` command), the ``*_cli`` modules and ``demo``."""
__version__ = "0.1.0"
