"""The Wireshark dissector for dosa, GENERATED from the wire definition (``dosa.wire``).

``lua()`` renders a Lua dissector that Wireshark and tshark load with ``-X lua_script:PATH``
(``dosa capture dissector`` writes it and prints PATH). Everything in it comes from wire.py's
tables, at the moment it is written, so it cannot drift from the protocol:

- the header fields (``HEADER_FIELDS``: names, order, sizes, signedness), packet types
  (``PacketType``) and flag bits (``Flags``);
- the payload layout per type (``PAYLOAD_BLOCKS``: blocks of ``count`` elements, each block
  zero-padded to 4 bytes; sparse offsets are relative to ``base``);
- the header rules (``HEADER_RULES``): each rule's expression is translated to Lua
  (:mod:`dosa.wireshark_rules`) from the same small expression language the C header check is
  generated from, and its message template
  becomes the text of the expert info, so a packet the dataplane would drop shows the counter it
  would move (``dosa.drop_reason``) and the same sentence ``wire.validate_header`` raises.

One check needs the job, not only the packet: an index outside its partition (the dataplane's
``index_out_of_partition``). The dissector takes the partition size as a preference
(``dosa.partition_size``, default ``wire.DEFAULT_PARTITION_SIZE``; 0 turns the check off).
Flow checks (unknown job, worker or source, not the owner, round window, duplicates) need the
control plane's state and are not shown. tests/unit/test_wireshark.py runs Debian's tshark on
packets of every type and every broken rule; tests/e2e/test_wireshark_capture.py on a real capture.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from dosa import wire
from dosa.wireshark_rules import HEADER_NAMES, lua_expr, lua_message, lua_str, names_in

#: The drop counter for an index outside its partition (dataplane/reasons.py; a test checks the name).
INDEX_REASON = "index_out_of_partition"
#: Header fields shown in hex (presentation only, as in the scapy layer).
HEX_FIELDS = {"magic", "flags"}
def default_path() -> Path:
    """Where ``dosa capture dissector`` writes the dissector ($XDG_CACHE_HOME/dosa or ~/.cache/dosa)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dosa" / f"dosa-v{wire.VERSION}.lua"


def write(path: str | os.PathLike | None = None) -> Path:
    """Write the dissector to ``path`` (default :func:`default_path`) unless it is already current."""
    path = Path(path) if path else default_path()
    text = lua()
    if not path.exists() or path.read_text() != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(text)
        os.replace(tmp, path)
    return path


# ------------------------------------------------------------------------------------------------
# The wire tables, normalized
# ------------------------------------------------------------------------------------------------
def payload_blocks() -> dict[int, list[tuple[str, np.dtype]]]:
    """Per type: the payload blocks in wire order, (name, element dtype)."""
    return {int(t): [(n, np.dtype(d)) for n, d in b] for t, b in wire.PAYLOAD_BLOCKS.items()}


def _elements(dt: np.dtype, name: str) -> list[tuple[str, int, np.dtype]]:
    """(field name, byte offset in the element, scalar dtype) of one block element."""
    if dt.names:
        return [(n, dt.fields[n][1], dt.fields[n][0]) for n in dt.names]
    return [(name, 0, dt)]


def _pad4(n: int) -> int:
    return -(-n // 4) * 4


def _check_layout(blocks) -> None:
    """The layout the dissector walks must give the lengths wire.payload_length says."""
    for t, bl in blocks.items():
        for count in range(0, 9):
            walked = wire.HDR_LEN + sum(_pad4(count * dt.itemsize) for _, dt in bl)
            want = int(wire.payload_length(t, count))
            if walked != want:
                raise ValueError(f"payload of {wire.PacketType(t).name} with {count} entries: blocks "
                                 f"padded to 4 give {walked} bytes, wire.payload_length {want}; "
                                 "teach dosa/wireshark.py the new layout")


# ------------------------------------------------------------------------------------------------
# The Lua text
# ------------------------------------------------------------------------------------------------
_PF = {("u", 1): "uint8", ("u", 2): "uint16", ("u", 4): "uint32",
       ("i", 1): "int8", ("i", 2): "int16", ("i", 4): "int32"}


def _protofield(abbr: str, label: str, dt: np.dtype, base: str = "base.DEC", extra: str = "") -> str:
    kind = _PF.get((dt.kind, dt.itemsize))
    if kind is None:
        raise ValueError(f"field {abbr}: dtype {dt} has no Wireshark field type here")
    return f'ProtoField.{kind}("{abbr}", {lua_str(label)}, {base}{extra})'


def lua() -> str:
    """The dissector's Lua source for the protocol in ``dosa.wire`` as imported now: its sections
    in order (each below renders one from the wire's tables)."""
    blocks = payload_blocks()
    _check_layout(blocks)
    flags = [f for f in wire.Flags if int(f)]
    fields, entry_fields = _lua_fields(blocks, flags)
    if "offset" not in entry_fields and "index" not in entry_fields:
        raise ValueError("no sparse index layout found in wire.PAYLOAD_BLOCKS")
    out = (_lua_prelude() + fields + _lua_experts() + _lua_prefs() + _lua_layout(blocks)
           + _lua_rules() + _lua_read_header(flags) + _LUA_ENTRIES + _lua_summary(flags)
           + _LUA_REGISTER)
    return "\n".join(out) + "\n"


def _lua_prelude() -> list[str]:
    """Bit operations for any Lua, the protocol object, the constants and the per-type tables."""
    sparse = {int(t) for t, v in wire.TYPE_TABLES["SPARSE"].items() if v}
    out: list[str] = [
        f"-- dosa wire protocol v{wire.VERSION}: Wireshark dissector GENERATED from dosa/wire.py by",
        "-- dosa/wireshark.py (`dosa capture dissector` writes it and prints its path). Do not edit.",
        "-- Load: tshark -X lua_script:THIS_FILE -r capture.pcap   (or Wireshark's personal plugins dir)",
        "-- Spec: docs/protocol.md; how it is made and checked: docs/capture.md.",
        "",
        "local band = bit32 and bit32.band or load('return function(a, b) return a & b end')()",
        "local bor = bit32 and bit32.bor or load('return function(a, b) return a | b end')()",
        "local bnot = bit32 and bit32.bnot or load('return function(a) return (~a) & 0xFFFFFFFF end')()",
        "local function b2i(x) if x then return 1 else return 0 end end",
        "",
        'local dosa = Proto("dosa", "dosa in-network gradient aggregation")',
        f"local HDR_LEN = {wire.HDR_LEN}",
        f"local DEFAULT_PORT = {wire.DEFAULT_PORT}",
    ]
    out += [f"local {k} = {int(v)}" for k, v in wire.RULE_CONSTANTS.items() if k != "HDR_LEN"]
    out.append("local TYPE_NAMES = {" + ", ".join(f"[{int(t)}] = {lua_str(t.name)}"
                                                  for t in wire.PacketType) + "}")
    for name, tab in wire.TYPE_TABLES.items():
        items = ", ".join(f"[{int(t)}] = {int(v)}" for t, v in tab.items() if v)
        out.append(f"local T_{name} = {{{items}}}")
        out.append(f"local function tab_{name}(t) return T_{name}[t] or 0 end")
    out.append("local SPARSE_TYPES = {" + ", ".join(f"[{t}] = true" for t in sorted(sparse)) + "}")
    return out


def _lua_fields(blocks, flags) -> tuple[list[str], dict[str, np.dtype]]:
    """The ProtoFields: the header's, the flag bits', every payload element's and the derived
    ones; returns them and the payload elements' dtypes."""
    out = ["", "local F = {}"]
    for n, dt, _ in wire.HEADER_FIELDS:
        dt = np.dtype(dt)
        base = "base.HEX" if n in HEX_FIELDS else "base.DEC"
        extra = ", TYPE_NAMES" if n == "type" else ""
        out.append(f"F.{n} = {_protofield('dosa.' + n, n, dt, base, extra)}")
    flag_width = 8 * np.dtype(dict((n, t) for n, t, _ in wire.HEADER_FIELDS)["flags"]).itemsize
    for f in flags:
        out.append(f'F.flag_{f.name.lower()} = ProtoField.bool("dosa.flags.{f.name.lower()}", '
                   f'"{f.name}", {flag_width}, nil, 0x{int(f):04X})')
    entry_fields: dict[str, np.dtype] = {}
    for bl in blocks.values():
        for bname, dt in bl:
            for en, _, edt in _elements(dt, bname):
                if entry_fields.setdefault(en, edt) != edt:
                    raise ValueError(f"payload field {en!r} has two dtypes ({entry_fields[en]}, {edt})")
    for en, edt in entry_fields.items():
        out.append(f"F.e_{en} = {_protofield('dosa.entry.' + en, en, edt)}")
    out += [
        'F.e_index = ProtoField.uint32("dosa.entry.index", "index", base.DEC, nil, nil, '
        '"base + offset (sparse) or base + position (dense)")',
        'F.padding = ProtoField.bytes("dosa.padding", "padding")',
        'F.trailing = ProtoField.bytes("dosa.trailing", "bytes beyond count")',
        'F.drop_reason = ProtoField.string("dosa.drop_reason", "dataplane verdict", base.ASCII, '
        '"the drop counter the XDP dataplane would move for this packet, or ok")',
        "dosa.fields = {}",
        "for _, f in pairs(F) do table.insert(dosa.fields, f) end",
    ]
    return out, entry_fields


def _lua_experts() -> list[str]:
    """One expert info per drop reason a packet can show."""
    reasons = list(dict.fromkeys([r.reason for r in wire.HEADER_RULES] + [INDEX_REASON]))
    out = ["", "local E = {}"]
    for r in reasons:
        out.append(f'E.{r} = ProtoExpert.new("dosa.drop.{r}", "dataplane drops it: {r}", '
                   "expert.group.MALFORMED, expert.severity.ERROR)")
    out += ["dosa.experts = {}", "for _, e in pairs(E) do table.insert(dosa.experts, e) end"]
    return out


def _lua_prefs() -> list[str]:
    """The dissector's preferences: its UDP port and the partition size of the index check."""
    return [
        "",
        'dosa.prefs.port = Pref.uint("UDP port", DEFAULT_PORT, "UDP port of the dosa protocol")',
        f'dosa.prefs.partition_size = Pref.uint("Partition size", {wire.DEFAULT_PARTITION_SIZE}, '
        '"indices per partition of the job (for the index-outside-partition check; 0 = off)")',
    ]


def _lua_layout(blocks) -> list[str]:
    """LAYOUT: each type's payload blocks and their elements (wire.PAYLOAD_BLOCKS), and the payload
    length they make."""
    out = ["", "-- payload blocks per type: {field, element size, {{name, offset, size, signed}...}}",
           "local LAYOUT = {"]
    for t, bl in blocks.items():
        items = []
        for bname, dt in bl:
            els = ", ".join(f'{{"{en}", {off}, {edt.itemsize}, {str(edt.kind == "i").lower()}}}'
                            for en, off, edt in _elements(dt, bname))
            items.append(f'{{"{bname}", {dt.itemsize}, {{{els}}}}}')
        out.append(f"  [{t}] = {{{', '.join(items)}}},")
    out += [
        "}",
        "local function pad4(n) return math.floor((n + 3) / 4) * 4 end",
        "local function payload_len(t, count)",
        "  local blocks = LAYOUT[t]",
        "  if not blocks then return 0 end",
        "  local n = HDR_LEN",
        "  for _, b in ipairs(blocks) do n = n + pad4(count * b[2]) end",
        "  return n",
        "end",
    ]
    return out


def _lua_rules() -> list[str]:
    """RULES: wire.HEADER_RULES in Lua, each with its message template."""
    out = ["", "-- wire.HEADER_RULES, in order: {reason, needs the header, broken(v), message(v)}",
           "local RULES = {"]
    for r in wire.HEADER_RULES:
        needs_header = bool(names_in(r.expr) & set(HEADER_NAMES))
        out.append(f"  {{{lua_str(r.reason)}, {str(needs_header).lower()}, "
                   f"function(v) return {lua_expr(r.expr)} end, "
                   f"function(v) return {lua_message(r.message)} end}},")
    out.append("}")
    return out


def _lua_read_header(flags) -> list[str]:
    """The dissector's start: every header field read and shown at its offset (HEADER_FIELDS)."""
    out = [
        "",
        "local function read(tvb, off, size, signed)",
        "  local r = tvb(off, size)",
        "  if signed then return r:int() end",
        "  return r:uint()",
        "end",
        "",
        "function dosa.dissector(tvb, pinfo, tree)",
        "  local length = tvb:reported_len()",
        '  pinfo.cols.protocol = "DOSA"',
        "  local root = tree:add(dosa, tvb())",
        "  local v = {length = length}",
        "  local have = tvb:len() >= HDR_LEN",
        "  if have then",
    ]
    off = 0
    for n, dt, _ in wire.HEADER_FIELDS:
        dt = np.dtype(dt)
        out.append(f"    v.{n} = read(tvb, {off}, {dt.itemsize}, {str(dt.kind == 'i').lower()})")
        if n == "flags":
            out.append(f"    local fi = root:add(F.flags, tvb({off}, {dt.itemsize}))")
            for f in flags:
                out.append(f"    fi:add(F.flag_{f.name.lower()}, tvb({off}, {dt.itemsize}))")
        else:
            out.append(f"    root:add(F.{n}, tvb({off}, {dt.itemsize}))")
        off += dt.itemsize
    assert off == wire.HDR_LEN
    return out


#: The dissector's middle, the same for every protocol version: the verdict (the first broken rule,
#: as the dataplane counts it), every payload element shown with its absolute index, padding and
#: trailing bytes, the index-outside-partition check.
_LUA_ENTRIES = [
    "  end",
    "  -- the first broken rule names the verdict (as the dataplane counts it)",
    '  local verdict, msg = "ok", nil',
    "  for _, r in ipairs(RULES) do",
    "    if (have or not r[2]) and r[3](v) then verdict, msg = r[1], r[4](v) break end",
    "  end",
    "  if not have and verdict == \"ok\" then verdict, msg = RULES[1][1], RULES[1][4](v) end",
    "  local blocks = have and LAYOUT[v.type] or nil",
    "  local ps = dosa.prefs.partition_size",
    "  local lo, hi = nil, nil",
    "  if have and ps > 0 then lo = v.partition * ps; hi = lo + ps end",
    "  local bad_index = nil",
    "  if blocks then",
    "    local off = HDR_LEN",
    "    for _, b in ipairs(blocks) do",
    "      local size = v.count * b[2]",
    "      local avail = math.max(0, math.min(size, tvb:len() - off))",
    "      local label = b[1] .. \": \" .. v.count .. \" x \" .. b[2] .. \" bytes\"",
    "      local bt = root",
    "      if avail > 0 then bt = root:add(tvb(off, avail), label) end",
    "      for i = 0, v.count - 1 do",
    "        local eo = off + i * b[2]",
    "        if eo + b[2] > tvb:len() then break end",
    "        for _, e in ipairs(b[3]) do",
    "          local item = bt:add(F[\"e_\" .. e[1]], tvb(eo + e[2], e[3]))",
    "          local idx = nil",
    "          if e[1] == \"offset\" and SPARSE_TYPES[v.type] then idx = v.base + read(tvb, eo + e[2], e[3], false)",
    "          elseif e[1] == \"index\" then idx = read(tvb, eo + e[2], e[3], false)",
    "          elseif e[1] == \"value\" and not SPARSE_TYPES[v.type] then idx = v.base + i end",
    "          if idx and e[1] ~= \"index\" then item:add(F.e_index, tvb(eo + e[2], e[3]), idx):set_generated() end",
    "          if idx and lo and (idx < lo or idx >= hi) and not bad_index then bad_index = idx end",
    "        end",
    "      end",
    "      off = off + size",
    "      local pad = pad4(size) - size",
    "      if pad > 0 and off + pad <= tvb:len() then root:add(F.padding, tvb(off, pad)) end",
    "      off = off + pad",
    "    end",
    "    if off < tvb:len() then root:add(F.trailing, tvb(off)) end",
    "  end",
    "  if verdict == \"ok\" and bad_index then",
    f'    verdict = "{INDEX_REASON}"',
    '    msg = string.format("index %d outside partition %d (%d..%d with partition size %d)", '
    "bad_index, v.partition, lo, hi - 1, ps)",
    "  end",
    "  local vi = root:add(F.drop_reason, verdict)",
    "  vi:set_generated()",
    "  if msg then root:add_proto_expert_info(E[verdict], msg) end",
    "  -- the one-line summary (as the scapy layer's)",
    "  if have then",
    '    local fl = {}',
]


def _lua_summary(flags) -> list[str]:
    """The dissector's end: the one-line summary (as the scapy layer's), with the flags set."""
    out = []
    for f in flags:
        out.append(f'    if band(v.flags, 0x{int(f):04X}) ~= 0 then table.insert(fl, "{f.name}") end')
    out += [
        '    local info = string.format("%s job=%d w=%d p=%d r=%d seq=%d/%d n=%d",',
        "      TYPE_NAMES[v.type] or (\"type \" .. v.type), v.job_id, v.worker_id, v.partition, v.round,",
        "      v.seq, v.total, v.count)",
        '    if #fl > 0 then info = info .. " " .. table.concat(fl, ",") end',
        '    if verdict ~= "ok" then info = info .. " [" .. verdict .. "]" end',
        "    pinfo.cols.info:set(info)",
        "    root:append_text(\", \" .. info)",
        "  else",
        '    pinfo.cols.info:set("DOSA [" .. verdict .. "]")',
        "  end",
        "  return length",
        "end",
        "",
    ]
    return out


#: Registration on the UDP port of the preference (again when it changes).
_LUA_REGISTER = [
    "local registered = nil",
    "local function register()",
    '  local udp = DissectorTable.get("udp.port")',
    "  if registered then udp:remove(registered, dosa) end",
    "  registered = dosa.prefs.port",
    "  udp:add(registered, dosa)",
    "end",
    "dosa.prefs_changed = register",
    "register()",
]


def header_field_names() -> list[str]:
    """The dissector's field names of the header, in wire order (``dosa.<field>``)."""
    return [f"dosa.{n}" for n in HEADER_NAMES]


def entry_field_names() -> list[str]:
    """The dissector's payload field names (``dosa.entry.<name>``, and the generated index)."""
    names = dict.fromkeys(en for bl in payload_blocks().values() for bn, dt in bl
                          for en, _, _ in _elements(dt, bn))
    return [f"dosa.entry.{n}" for n in [*names, "index"] if n]


def tshark_fields(pcap: str | os.PathLike, fields: list[str], lua_path: str | os.PathLike | None = None,
                  display_filter: str = "dosa", port: int | None = None) -> list[dict[str, list[str]]]:
    """Run Debian's tshark with this dissector on ``pcap``: per displayed packet, each field's
    values as tshark prints them (all occurrences, in order). ``frame.number`` is always included."""
    import shutil
    import subprocess

    from dosa.errors import DosaError

    if not shutil.which("tshark"):
        raise DosaError("tshark is not installed (Debian package tshark; make setup installs it)")
    lua_path = lua_path or write()
    fields = ["frame.number", *[f for f in fields if f != "frame.number"]]
    argv = ["tshark", "-n", "-r", str(pcap), "-X", f"lua_script:{lua_path}", "-Y", display_filter,
            "-T", "fields", "-E", "separator=/t", "-E", "occurrence=a", "-E", "aggregator=;"]
    if port is not None:
        argv += ["-o", f"dosa.port:{port}"]
    for f in fields:
        argv += ["-e", f]
    p = subprocess.run(argv, capture_output=True, text=True)
    err = "\n".join(line for line in p.stderr.splitlines() if "Running as user" not in line).strip()
    if p.returncode != 0 or "Lua" in err:
        raise DosaError(f"tshark failed on {pcap} (exit {p.returncode}): {err}")
    rows = []
    for line in p.stdout.splitlines():
        cols = line.split("\t")
        rows.append({f: (c.split(";") if c else []) for f, c in zip(fields, cols + [""] * len(fields))})
    return rows


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m dosa.wireshark", description=__doc__.split("\n")[0])
    p.add_argument("--out", help=f"write here (default {default_path()})")
    p.add_argument("--stdout", action="store_true", help="print the Lua instead of writing a file")
    a = p.parse_args(argv)
    if a.stdout:
        print(lua(), end="")
    else:
        print(write(a.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
