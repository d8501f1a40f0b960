"""``dosa capture show PCAP`` and ``dosa capture verify PCAP``: read a capture of a dosa fabric,
list its packets per (job, round, partition), and check every result against the data (exit 0 all
verified, 1 on any mismatch or nothing to verify, 2 for bad input). See docs/capture.md."""
from __future__ import annotations

import json

from dosa import wire
from dosa.capture import read_capture, summarize, verify


def register(subparsers) -> None:
    cap = subparsers.add_parser("capture", help="inspect and verify pcap captures of dosa traffic")
    sub = cap.add_subparsers(dest="capture_cmd", metavar="SUBCOMMAND")
    cap.set_defaults(func=lambda a: (cap.print_help(), 2)[1])

    def common(p):
        p.add_argument("pcap", help="pcap or pcapng file (tcpdump -w, dosa testbed capture)")
        p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
        p.add_argument("--port", type=int, default=None,
                       help="only UDP packets from/to this port (default: any port, recognised by "
                            f"the dosa magic; the default deployment port is {wire.DEFAULT_PORT})")

    show = sub.add_parser("show", help="dosa packets per (job, round, partition) and per worker")
    common(show)
    show.add_argument("--limit", type=int, default=None, help="print at most this many groups")
    show.set_defaults(func=cmd_show)
    ver = sub.add_parser("verify", help="recompute every sum from the data packets and compare with "
                                        "the DPU's result packets")
    common(ver)
    ver.add_argument("--partial-edges", action="store_true",
                     help="accept incomplete rounds before a job's first complete round and after "
                          "its last (a capture started or stopped mid-run); one in between always "
                          "fails")
    ver.set_defaults(func=cmd_verify)
    dis = sub.add_parser("dissector", help="write the Wireshark dissector (Lua, generated from "
                                           "dosa/wire.py) and print its path: tshark -X lua_script:PATH")
    dis.add_argument("--out", help="write it here (default: ~/.cache/dosa/dosa-vN.lua)")
    dis.set_defaults(func=cmd_dissector)


def _port(args):
    if args.port is not None and not 0 < args.port < 65536:
        from dosa.errors import DosaError

        raise DosaError(f"--port {args.port} is not a UDP port (1..65535)")
    return args.port


def _counts_line(s: dict) -> str:
    mal = ", ".join(f"{k} {v}" for k, v in s["malformed_by_reason"].items())
    parts = [f"{s['frames']} frames", f"{s['dosa_packets']} dosa packets",
             f"{s['non_dosa']} other (ignored)", f"{s['malformed']} malformed" + (f" ({mal})" if mal else "")]
    if s["truncated_by_snaplen"]:
        parts.append(f"{s['truncated_by_snaplen']} cut by the snap length")
    if s["truncated_file"]:
        parts.append("last record truncated")
    return ", ".join(parts)


def cmd_show(args) -> int:
    cap = read_capture(args.pcap, port=_port(args))
    s = summarize(cap)
    if args.limit is not None:
        s["groups"] = s["groups"][: args.limit]
    if args.json:
        print(json.dumps(s, indent=1))
        return 0
    print(_counts_line(s))
    if s["other_packets"]:
        print("other dosa packets: " + ", ".join(f"{k} {v}" for k, v in s["other_packets"].items()))
    print(f"{s['partitions']} (job, round, partition) groups in {s['rounds']} rounds")
    print(f"{'job':>6} {'round':>7} {'part':>5}  {'sender':<8} {'pkts':>5} {'dups':>5} {'seqs':>9} "
          f"{'entries':>8} {'scale':>5}  notes")
    for gr in s["groups"]:
        lead = f"{gr['job']:>6} {gr['round']:>7} {gr['partition']:>5}"
        lines = []
        for w in gr["workers"]:
            lines.append(("w" + str(w["worker"]), w, "dense" if w["dense"] else ""))
        r = gr["result"]
        if r:
            notes = " ".join(n for n, on in (("gtopk", r["gtopk"]), ("dense", r["dense"])) if on)
            lines.append(("DPU", r, notes))
        else:
            lines.append(("DPU", None, "no result packets"))
        for k, (who, x, notes) in enumerate(lines):
            head = lead if k == 0 else " " * len(lead)
            if x is None:
                print(f"{head}  {who:<8} {'-':>5} {'-':>5} {'-':>9} {'-':>8} {'-':>5}  {notes}")
                continue
            seqs = f"{x['seqs']}/{x['total']}"
            print(f"{head}  {who:<8} {x['packets']:>5} {x['duplicates']:>5} {seqs:>9} {x['entries']:>8} "
                  f"{x['scale_exp']:>5}  {notes}")
    return 0


def cmd_verify(args) -> int:
    cap = read_capture(args.pcap, port=_port(args))
    rep = verify(cap, partial_edges=args.partial_edges)
    if args.json:
        print(json.dumps(rep, indent=1))
        return 0 if rep["ok"] else 1
    print(_counts_line(cap.stats))
    print(f"verified {rep['verified']} of {rep['partitions']} complete partition results in "
          f"{rep['rounds']} rounds ({rep['gtopk_partitions']} gtopk, {rep['entries_checked']} result "
          f"entries); {len(rep['incomplete'])} incomplete in the capture")
    for m in rep["mismatches"]:
        kinds = ", ".join(f"{k} {v}" for k, v in m["kinds"].items())
        print(f"MISMATCH job {m['job']} round {m['round']} partition {m['partition']} ({m['mode']}): "
              f"{m['problems']} problems: {kinds}")
        for d in m["details"]:
            print("    " + " ".join(f"{k}={v}" for k, v in d.items()))
    for inc in rep["incomplete"][:20]:
        print(f"incomplete job {inc['job']} round {inc['round']} partition {inc['partition']}: "
              + "; ".join(inc["missing"]))
    if len(rep["incomplete"]) > 20:
        print(f"... and {len(rep['incomplete']) - 20} more incomplete")
    if rep["ok"]:
        print("OK")
    elif not rep["mismatches"]:
        if rep["incomplete_inner"]:
            why = (f"{rep['incomplete_inner']} incomplete partition(s) between complete rounds: "
                   "packets missing from the capture")
        elif rep["verified"]:
            why = ("incomplete rounds at the capture's start or end (--partial-edges accepts "
                   "those)")
        elif not cap.stats["dosa_packets"]:
            why = "nothing could be verified: no dosa packets in the capture" + (
                f" on port {args.port}" if args.port is not None else "")
        else:
            why = "nothing could be verified (no partition with complete data and result)"
        print("FAILED: " + why)
    else:
        print(f"FAILED: {len(rep['mismatches'])} partition results do not match their data")
    return 0 if rep["ok"] else 1


def cmd_dissector(args) -> int:
    from dosa import wireshark

    print(wireshark.write(args.out))
    return 0
