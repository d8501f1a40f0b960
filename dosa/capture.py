"""Read dosa packets out of a capture file and check the DPU's results against the workers' data.

Three parts, one job each: :mod:`dosa.capture_pcap` (pcap/pcapng -> frames -> UDP payloads),
:mod:`dosa.capture_decode` (payloads -> validated dosa packets and entries), :mod:`dosa.capture_verify`
(grouping, ``dosa capture show``'s summary, ``dosa capture verify``). This module is their public
face: import from here. See docs/capture.md.
"""
from __future__ import annotations

from dosa.capture_decode import DosaCapture, read_capture
from dosa.capture_pcap import Frames, UdpPayloads, read_frames, udp_payloads
from dosa.capture_verify import Groups, group, summarize, verify

__all__ = ["DosaCapture", "Frames", "Groups", "UdpPayloads", "group", "read_capture", "read_frames",
           "summarize", "udp_payloads", "verify"]
