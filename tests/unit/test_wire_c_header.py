"""dosa/dosa_wire.h is generated from dosa/wire.py (``python -m dosa.gen_headers``): the
checked-in file must be exactly what the generator writes, and what it means must mirror wire.py:
every struct dosa_hdr field at the same offset with the same size, signedness and declared C type,
every #define and enum value equal to its Python counterpart, and the generated C header check
giving the same verdict as wire.header_verdicts on many random headers. The C side is measured by
compiling programs against the header (so the preprocessor and compiler, not a regex, say what it
means)."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from dataplane import reasons
from dosa import gen_headers
from dosa import counters, wire

pytestmark = pytest.mark.timeout(60)

HEADER = Path(__file__).resolve().parents[2] / "dosa" / "dosa_wire.h"


def _c_names() -> tuple[list[str], list[str]]:
    """(#define names of constants, enum dosa_type member names)."""
    text = HEADER.read_text()
    defines = [m for m in re.findall(r"^#define[ \t]+(DOSA_\w+)[ \t]+\S", text, re.M)]
    enum_body = re.search(r"enum dosa_type\s*{(.*?)}", text, re.S).group(1)
    enums = re.findall(r"(DOSA_T_\w+)\s*=", enum_body)
    return defines, enums


def _python_value(cname: str) -> int:
    """The wire.py value a C constant must equal, by the naming rule DOSA_X -> wire.X,
    DOSA_T_X -> PacketType.X, DOSA_F_X -> Flags.X (DOSA_F_VALID_MASK -> FLAGS_VALID_MASK)."""
    if cname.startswith("DOSA_T_"):
        return int(wire.PacketType[cname[len("DOSA_T_"):]])
    if cname == "DOSA_NUM_COUNTERS":
        return counters.NUM_COUNTERS
    if cname == "DOSA_F_VALID_MASK":
        return wire.FLAGS_VALID_MASK
    if cname.startswith("DOSA_F_"):
        return int(wire.Flags[cname[len("DOSA_F_"):]])
    return int(getattr(wire, cname[len("DOSA_"):]))


@pytest.fixture(scope="module")
def c_layout(tmp_path_factory):
    """Compile and run a program printing ``name value`` lines for every layout fact and constant."""
    cc = shutil.which("gcc") or shutil.which("cc")
    assert cc, "gcc is required to check dosa/dosa_wire.h (apt-get install gcc)"
    defines, enums = _c_names()
    lines = ["#include <stdio.h>", "#include <stddef.h>", f'#include "{HEADER}"',
             "#define F(s, f) ((struct s *)0)->f",
             "#define SIGNED(s, f) ((__typeof__(F(s, f)))-1 < 0)"]
    # Declared C types from HEADER_FIELDS: a compile error if the header declares another type.
    for name, _, ctype in wire.HEADER_FIELDS:
        lines.append(f"_Static_assert(__builtin_types_compatible_p(__typeof__(F(dosa_hdr, {name})), "
                     f"{ctype}), \"dosa_hdr.{name} is not {ctype}\");")
    lines.append("int main(void) {")
    lines.append('printf("sizeof.dosa_hdr %zu\\n", sizeof(struct dosa_hdr));')
    lines.append('printf("alignof.dosa_hdr %zu\\n", _Alignof(struct dosa_hdr));')
    for name, _, _ in wire.HEADER_FIELDS:
        lines.append(f'printf("hdr.{name} %zu %zu %d\\n", offsetof(struct dosa_hdr, {name}), '
                     f"sizeof(F(dosa_hdr, {name})), (int)SIGNED(dosa_hdr, {name}));")
    for n in range(0, wire.RX_MAX_SPARSE_ENTRIES + 1):
        lines.append(f'printf("value_offset.{n} %d\\n", (int)DOSA_VALUE_OFFSET({n}));')
    for c in defines + enums:
        lines.append(f'printf("const.{c} %lld\\n", (long long)({c}));')
    lines.append("return 0; }")
    d = tmp_path_factory.mktemp("wireh")
    src, exe = d / "layout.c", d / "layout"
    src.write_text("\n".join(lines) + "\n")
    r = subprocess.run([cc, "-std=gnu11", "-Wall", "-Werror", "-o", str(exe), str(src)],
                       capture_output=True, text=True)
    assert r.returncode == 0, f"dosa_wire.h does not match wire.HEADER_FIELDS / compile:\n{r.stderr}"
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    return {k: v.split() for k, v in (ln.split(" ", 1) for ln in out.splitlines())}


def test_header_struct_size_and_alignment(c_layout):
    assert int(c_layout["sizeof.dosa_hdr"][0]) == wire.HDR_LEN == wire.HEADER_DTYPE.itemsize
    assert int(c_layout["alignof.dosa_hdr"][0]) == 4  # the spec promises 4-byte alignment


@pytest.mark.parametrize("name", [n for n, _, _ in wire.HEADER_FIELDS])
def test_header_field_offset_size_sign_match(c_layout, name):
    off, size, signed = map(int, c_layout[f"hdr.{name}"])
    py_dtype, py_off = wire.HEADER_DTYPE.fields[name]
    assert (off, size) == (py_off, py_dtype.itemsize), f"dosa_hdr.{name} drifted"
    assert bool(signed) == (py_dtype.kind == "i"), f"dosa_hdr.{name} signedness drifted"


def test_sparse_value_block_offset_matches(c_layout):
    """Where XDP reads a sparse packet's s32 values is where wire.value_offset puts them."""
    for n in range(0, wire.RX_MAX_SPARSE_ENTRIES + 1):
        assert int(c_layout[f"value_offset.{n}"][0]) == wire.value_offset(n)


def test_every_c_constant_equals_python(c_layout):
    consts = {k[len("const."):]: int(v[0]) for k, v in c_layout.items() if k.startswith("const.")}
    assert consts, "no constants found in dosa_wire.h"
    wrong = {c: (v, _python_value(c)) for c, v in consts.items() if v != _python_value(c)}
    assert not wrong, f"C value vs wire.py value: {wrong}"


def test_every_python_type_and_flag_is_in_c():
    defines, enums = _c_names()
    assert {f"DOSA_T_{t.name}" for t in wire.PacketType} == set(enums)
    assert {f"DOSA_F_{f.name}" for f in wire.Flags if f} <= set(defines)
    for needed in ("MAGIC", "VERSION", "HDR_LEN", "RX_MAX_SPARSE_ENTRIES", "RX_MAX_DENSE_ENTRIES",
                   "MAX_MTU", "MAX_PACKETS_PER_CONTRIBUTION", "MAX_WORKERS", "MAX_PARTITIONS",
                   "DPU_SENDER_ID", "SCALE_EXP_MIN", "SCALE_EXP_MAX", "MAX_SPARSE_BASE"):
        assert f"DOSA_{needed}" in defines


def test_header_field_list_is_complete():
    """Every field of struct dosa_hdr, in declaration order, is a HEADER_FIELDS entry (and back)."""
    body = re.search(r"struct dosa_hdr\s*{(.*?)}", HEADER.read_text(), re.S).group(1)
    c_fields = re.findall(r"(\w+)\s*;", body)
    assert c_fields == [n for n, _, _ in wire.HEADER_FIELDS]


def test_checked_in_header_and_pxd_are_the_generated_ones():
    assert HEADER.read_text() == wire.c_header(), "run: python -m dosa.gen_headers"
    assert HEADER.with_suffix(".pxd").read_text() == wire.c_pxd(), "run: python -m dosa.gen_headers"
    assert gen_headers.main(["--check"]) == 0


def test_the_pxd_declares_every_accessor_and_constant_of_the_header():
    """The Cython declarations (dosa_wire.pxd) name exactly the header's accessors, and every
    constant and enum member the header defines, so no compiled module declares one by hand."""
    text, pxd = HEADER.read_text(), HEADER.with_suffix(".pxd").read_text()
    c_funcs = set(re.findall(r"static __always_inline \w+ (dosa_(?:hdr|sparse|dense|retx|status|put)_\w+)\(",
                             text))
    pxd_funcs = set(re.findall(r"^    \w+ (dosa_\w+)\(", pxd, re.M))
    c_funcs -= {"dosa_put_be16", "dosa_put_be32"}  # the accessors' own byte order, for no caller
    assert c_funcs and c_funcs <= pxd_funcs
    defines, enums = _c_names()
    counters_ = re.findall(r"^\t(DOSA_C_\w+) =", text, re.M)
    declared = set(re.findall(r"^        (DOSA_\w+)$", pxd, re.M)) | set(re.findall(r"uint32_t (DOSA_\w+)$", pxd, re.M))
    assert set(defines) - {"DOSA_VALUE_OFFSET"} | set(enums) | set(counters_) <= declared


def _packets(seed: int) -> list[bytes]:
    """Valid packets of every type with entries, odd and even counts, built by wire.build_packet."""
    rng = np.random.default_rng(seed)
    out = []
    for t in wire.PacketType:
        for count in (0, 1, 2, 7, wire.MAX_ENTRIES[t]):
            if not wire.PAYLOAD_BLOCKS[t] and count:
                continue
            seq_total = (0, 1) if t in wire.SEQUENCED_TYPES else (0, 0)
            base = int(rng.integers(0, wire.MAX_SPARSE_BASE)) if t in wire.SPARSE_TYPES else 0
            h = wire.Header(type=t, job_id=int(rng.integers(1, 2**32)), worker_id=int(rng.integers(0, 64)),
                            partition=int(rng.integers(0, 65535)), round=int(rng.integers(0, 2**32)),
                            seq=seq_total[0], total=seq_total[1], flags=int(wire.Flags.LAST) if seq_total[1] else 0,
                            scale_exp=int(rng.integers(-32, 63)), base=base)
            if t in wire.SPARSE_TYPES:
                idx = np.sort(rng.choice(65536, count, replace=False)) + base
                e = np.stack([idx, rng.integers(-2**31, 2**31, count)], 1)
            else:
                e = rng.integers(-2**31 if t in (wire.PacketType.DENSE_DATA, wire.PacketType.DENSE_RESULT)
                                 else 0, 2**31, count)
            out.append(wire.build_packet(h, e))
    return out


def test_generated_accessors_read_what_parse_packet_reads(tmp_path):
    """Every header field and entry of packets of every type, read in C through the generated
    accessors (gcc), equals what wire.parse_packet reads; and the writers rebuild the same bytes."""
    cc = shutil.which("gcc") or shutil.which("cc")
    assert cc, "gcc is required to check dosa/dosa_wire.h (apt-get install gcc)"
    fields = [n for n, _, _ in wire.HEADER_FIELDS]
    prints = " ".join(f'printf("%lld ", (long long)dosa_hdr_{n}(b));' for n in fields)
    src, exe = tmp_path / "acc.c", tmp_path / "acc"
    src.write_text("\n".join([
        "#include <stdio.h>", "#include <string.h>", f'#include "{HEADER}"',
        "int main(void) { unsigned char b[4096], w[4096]; unsigned int len, c, j, t;",
        "  while (fread(&len, 4, 1, stdin) == 1 && fread(b, 1, len, stdin) == len) {",
        f"    {prints}",
        "    c = dosa_hdr_count(b); t = dosa_hdr_type(b); memcpy(w, b, 32); memset(w + 32, 0xAA, len - 32);",
        "    if (dosa_sparse(t)) dosa_put_sparse_pad(w, c);",
        "    for (j = 0; j < c; j++) {",
        "      if (dosa_sparse(t)) { printf(\"%u:%d \", dosa_hdr_base(b) + dosa_sparse_offset(b, c, j), dosa_sparse_value(b, c, j));",
        "        dosa_put_sparse_offset(w, c, j, dosa_sparse_offset(b, c, j)); dosa_put_sparse_value(w, c, j, dosa_sparse_value(b, c, j)); }",
        "      else if (dosa_dense(t)) { printf(\"%d \", dosa_dense_value(b, c, j)); dosa_put_dense_value(w, c, j, dosa_dense_value(b, c, j)); }",
        "      else if (t == DOSA_T_RETX_REQUEST) { printf(\"%u \", dosa_retx_seq(b, c, j)); dosa_put_retx_seq(w, c, j, dosa_retx_seq(b, c, j)); }",
        "      else { printf(\"%u \", dosa_status_worker_id(b, c, j)); dosa_put_status_worker_id(w, c, j, dosa_status_worker_id(b, c, j)); }",
        "    }",
        "    printf(\"| %d\\n\", memcmp(w, b, len) == 0);",
        "  }",
        "  return 0; }"]) + "\n")
    r = subprocess.run([cc, "-std=gnu11", "-O1", "-Wall", "-Wextra", "-Werror", "-o", str(exe), str(src)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    pkts = _packets(seed=5)
    blob = b"".join(np.uint32(len(p)).tobytes() + p for p in pkts)
    out = subprocess.run([str(exe)], input=blob, capture_output=True, check=True).stdout.decode().splitlines()
    assert len(out) == len(pkts) > 30
    for p, line in zip(pkts, out):
        h, e = wire.parse_packet(p)
        head, rest = line.split(" | ")
        got = head.split()
        assert [int(x) for x in got[:len(fields)]] == [getattr(h, n) for n in fields]
        entries = got[len(fields):]
        if h.type in wire.SPARSE_TYPES:
            want = [f"{int(i)}:{int(v)}" for i, v in zip(e["index"], e["value"])]
        else:
            want = [str(int(v)) for v in e]
        assert entries == want, wire.PacketType(h.type).name
        assert rest == "1", f"the writers did not rebuild the {wire.PacketType(h.type).name} packet"


def test_every_rule_reason_is_a_dataplane_counter():
    names = {reasons.name(c) for c in reasons.Counter}
    assert {r.reason for r in wire.HEADER_RULES} <= names


def _random_headers(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Mostly valid headers with one or two fields pushed to interesting values, and lengths that
    are mostly right: every rule is broken by some rows, many rows by none."""
    rng = np.random.default_rng(seed)
    h = np.zeros(n, wire.HEADER_DTYPE)
    h["magic"], h["version"], h["job_id"] = wire.MAGIC, wire.VERSION, rng.integers(1, 2**32, n)
    h["type"] = rng.integers(1, len(wire.PacketType) + 1, n)
    h["total"] = rng.integers(1, 5, n)
    h["seq"] = rng.integers(0, 5, n) % h["total"]
    h["flags"] = (h["seq"] == h["total"] - 1) * int(wire.Flags.LAST)
    h["count"] = rng.integers(0, 4, n)
    h["worker_id"] = rng.integers(0, wire.MAX_WORKERS, n)
    h["scale_exp"] = rng.integers(wire.SCALE_EXP_MIN, wire.SCALE_EXP_MAX + 1, n)
    length = np.array([wire.payload_length(int(t), int(c)) for t, c in zip(h["type"], h["count"])])
    for name, dt, _ in wire.HEADER_FIELDS:  # break fields at random: full range of the type
        hit = rng.random(n) < 0.06
        info = np.iinfo(np.dtype(dt))
        h[name][hit] = rng.integers(info.min, int(info.max) + 1, int(hit.sum()))
        edge = rng.random(n) < 0.03
        h[name][edge] = rng.choice([info.min, info.max, 0, 1, 255], int(edge.sum()))
    off = rng.random(n) < 0.08
    length[off] += rng.integers(-40, 40, int(off.sum()))
    return h, np.maximum(length, 0)


def test_generated_c_check_agrees_with_python_on_random_headers(tmp_path):
    """The same header bytes through dosa_check_header (gcc) and wire.header_verdicts: one verdict."""
    cc = shutil.which("gcc") or shutil.which("cc")
    assert cc, "gcc is required to check dosa/dosa_wire.h (apt-get install gcc)"
    src, exe = tmp_path / "check.c", tmp_path / "check"
    src.write_text("\n".join([
        "#include <stdio.h>", "#include <stdint.h>", f'#include "{HEADER}"',
        "int main(void) { unsigned char b[32]; unsigned int len;",
        "  while (fread(b, 1, 32, stdin) == 32 && fread(&len, 4, 1, stdin) == 1)",
        "    printf(\"%d\\n\", dosa_check_header((const struct dosa_hdr *)b, len));",
        "  return 0; }"]) + "\n")
    r = subprocess.run([cc, "-std=gnu11", "-O1", "-Wall", "-Werror", "-o", str(exe), str(src)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    h, length = _random_headers(20000, seed=12)
    rec = np.zeros(len(h), [("h", wire.HEADER_DTYPE), ("len", "<u4")])
    rec["h"], rec["len"] = h, length
    out = subprocess.run([str(exe)], input=rec.tobytes(), capture_output=True, check=True).stdout
    c_counter = np.array(out.split(), np.int64)
    code = wire.header_verdicts(h, length)
    py_counter = np.array([-1 if c == 0 else int(reasons.Counter[wire.RULE_REASONS[c].upper()])
                           for c in code])
    assert len(c_counter) == len(h)
    assert (code == 0).sum() > 1000 and len(set(code.tolist())) == len(wire.HEADER_RULES) + 1, \
        "the random headers must hit every rule and many valid rows"
    bad = np.flatnonzero(c_counter != py_counter)
    assert not len(bad), f"C and Python disagree on {len(bad)} headers, first {h[bad[0]]}, len {length[bad[0]]}"
