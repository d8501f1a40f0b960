"""The header rules of dosa.wire (``wire.HEADER_RULES``) in Lua, for the generated Wireshark
dissector (:mod:`dosa.wireshark`): each rule's expression, written in the small language the C check
is generated from too, becomes a Lua boolean expression over the header's fields ``v.<field>``, and
its message template a ``string.format`` call, so the dissector shows the sentence
``wire.validate_header`` raises. What cannot be translated is a ValueError naming it.
"""
from __future__ import annotations

import ast
import string

from dosa import wire

#: Names a rule message may use besides fields, ``length`` and constants: how the dissector
#: computes them (the same quantities ``wire.rule_error`` puts in its context).
DERIVED = {
    "type_name": "(TYPE_NAMES[v.type] or tostring(v.type))",
    "max_entries": "tab_MAX_ENTRIES(v.type)",
    "want": "payload_len(v.type, v.count)",
    "bad_flags": "band(v.flags, bnot(F_VALID_MASK))",
    "max_worker": str(wire.MAX_WORKERS - 1),
    "max_partition": str(wire.MAX_PARTITIONS - 1),
}


HEADER_NAMES = [n for n, _, _ in wire.HEADER_FIELDS]


def lua_expr(expr: str) -> str:
    """A rule expression (True where broken) as a Lua boolean expression over ``v.<field>``."""
    node = ast.parse(expr, mode="eval").body

    def as_int(code_kind):
        code, kind = code_kind
        return f"b2i({code})" if kind == "bool" else code

    def go(n):
        if isinstance(n, ast.Name):
            if n.id in HEADER_NAMES or n.id == "length":
                return f"v.{n.id}", "int"
            if n.id in wire.RULE_CONSTANTS:
                return n.id, "int"
            raise ValueError(f"rule {expr!r} names {n.id!r}: neither a field, length nor a constant")
        if isinstance(n, ast.Constant) and isinstance(n.value, int):
            return str(n.value), "int"
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in wire.TYPE_TABLES \
                and len(n.args) == 1:
            return f"tab_{n.func.id}({as_int(go(n.args[0]))})", "int"
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.Invert):
            return f"bnot({as_int(go(n.operand))})", "int"
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.USub):
            return f"(-{as_int(go(n.operand))})", "int"
        if isinstance(n, ast.BinOp):
            a, c = as_int(go(n.left)), as_int(go(n.right))
            ops = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*"}
            if type(n.op) in ops:
                return f"({a} {ops[type(n.op)]} {c})", "int"
            fn = {ast.BitAnd: "band", ast.BitOr: "bor"}.get(type(n.op))
            if fn:
                return f"{fn}({a}, {c})", "int"
        if isinstance(n, ast.Compare) and len(n.ops) == 1:
            ops = {ast.Eq: "==", ast.NotEq: "~=", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">="}
            if type(n.ops[0]) in ops:
                return (f"({as_int(go(n.left))} {ops[type(n.ops[0])]} "
                        f"{as_int(go(n.comparators[0]))})"), "bool"
        raise ValueError(f"rule {expr!r}: the dissector generator cannot translate {ast.dump(n)}")

    code, kind = go(node)
    return code if kind == "bool" else f"({code} ~= 0)"


def names_in(expr: str) -> set[str]:
    return {n.id for n in ast.walk(ast.parse(expr, mode="eval")) if isinstance(n, ast.Name)}


def lua_str(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def lua_message(template: str) -> str:
    """A rule's message template (str.format) as a Lua string.format call over ``v``."""
    fmt, args = [], []
    for text, name, spec, conv in string.Formatter().parse(template):
        fmt.append(text.replace("%", "%%"))
        if name is None:
            continue
        if conv:
            raise ValueError(f"message {template!r}: conversion !{conv} not supported")
        if name in HEADER_NAMES or name == "length":
            args.append(f"v.{name}")
        elif name in wire.RULE_CONSTANTS:
            args.append(name)
        elif name in DERIVED:
            args.append(DERIVED[name])
        else:
            raise ValueError(f"message {template!r} names {name!r}, which dosa/wireshark.py does not "
                             "know how to compute (add it to DERIVED, as wire.rule_error computes it)")
        if spec == "":
            fmt.append("%s" if name == "type_name" else "%d")
        elif spec.rstrip("xXd").lstrip("0").isdigit() or spec in ("x", "X", "d"):
            fmt.append("%" + spec)
        else:
            raise ValueError(f"message {template!r}: format spec {spec!r} not supported")
    return f"string.format({lua_str(''.join(fmt))}{''.join(', ' + a for a in args)})"
