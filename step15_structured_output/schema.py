"""JSON Schema（一个有文档的子集）→ 正则（Outlines 的做法），再交给 automaton.py 编译成 DFA。

空白：紧凑，分隔符是 ", " 与 ": "，别处没有空白，空容器写成 [] 与 {}——与 xgrammar 的
compile_json_schema(any_whitespace=False) 逐字节相同（两边的语言一样，掩码才能逐位比较）。
允许任意空白的语法里，模型可以一直输出空白直到 max_tokens（vLLM、Outlines 都因此改过默认的空白规则）；
紧凑格式没有这个出口。

支持的关键字：
    type（字符串或列表）、enum、const、anyOf、$ref（只在本文档内，"#/..."，不能递归）、$defs / definitions
    object：properties（按声明的顺序输出）、required、additionalProperties（只接受不写或 false）
    string：minLength、maxLength、pattern（整串匹配，同 xgrammar / Outlines）
    integer、number、boolean、null
    array：items、minItems、maxItems
    注释性关键字 title、description、$comment、examples、default、$schema 不影响哪些 JSON 合法，照收
其余关键字（minimum、format、oneOf、allOf、prefixItems、patternProperties……）都报错并说出名字，绝不悄悄丢掉：
丢掉一个约束，模型写出的 JSON 就可能不满足用户给的 schema（SGLang、vLLM 都因此修过）。

可选属性（不在 required 里）：按声明顺序，每个可以出现也可以不出现（与 xgrammar 相同）。
没写 additionalProperties 时只生成声明过的属性（xgrammar 的 strict_mode、OpenAI 的 strict 都这样）：
这是收窄，生成的 JSON 仍然满足 schema。

JSON 不是正则语言：嵌套的 [ ] { } 要配对，需要一个栈（下推自动机，xgrammar 用的就是它）。有限自动机只能数到
固定的深度，所以"任意 JSON"（response_format 的 json_object、没写 properties 的 object、没写 items 的 array）
在这里是嵌套深度不超过 max_depth 的 JSON。$ref 递归同理（会无限展开），报错。
"""
import json

from .regex_parser import GrammarError, escape_char, parse_regex, to_regex

REGEX_SPECIAL = "\\.^$|?*+()[]{}"
STRING_CHAR = r'(?:[^\x00-\x1f"\\]|\\(?:["\\/bfnrt]|u[0-9A-Fa-f]{4}))'   # 一个 JSON 字符串里的字符
STRING = f'"{STRING_CHAR}*"'
INTEGER = r"(?:0|-?[1-9][0-9]*)"
NUMBER = r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
BOOLEAN = "(?:true|false)"
NULL = "null"
SCALARS = {"string": STRING, "integer": INTEGER, "number": NUMBER, "boolean": BOOLEAN, "null": NULL}
DEFAULT_MAX_DEPTH = 3              # 同 Outlines 的 max_recursion_depth=3

ANNOTATIONS = {"title", "description", "$comment", "examples", "default", "$schema"}
COMMON = {"type", "enum", "const", "anyOf", "$ref", "$defs", "definitions"} | ANNOTATIONS
BY_TYPE = {"object": {"properties", "required", "additionalProperties"},
           "array": {"items", "minItems", "maxItems"},
           "string": {"minLength", "maxLength", "pattern"},
           "integer": set(), "number": set(), "boolean": set(), "null": set()}


def literal(text: str) -> str:
    """一段必须原样出现的文本 → 正则。"""
    return "".join(escape_char(ord(c), REGEX_SPECIAL) for c in text)


def dump(value) -> str:
    """值按我们的空白策略写成 JSON 文本（enum / const 用）。"""
    try:
        return json.dumps(value, ensure_ascii=False, separators=(", ", ": "), allow_nan=False)
    except ValueError:                          # NaN / Infinity 不是 JSON
        raise GrammarError(f"enum/const value {value!r} is not valid JSON") from None


def group(alternatives: list[str]) -> str:
    return alternatives[0] if len(alternatives) == 1 else "(?:" + "|".join(alternatives) + ")"


def any_value(depth: int) -> str:
    """任意 JSON 值，容器最多嵌套 depth 层（depth=0：只有标量）。"""
    scalars = [NUMBER, STRING, BOOLEAN, NULL]
    if depth == 0:
        return group(scalars)
    return group(scalars + [any_array(depth), any_object(depth)])


def any_array(depth: int) -> str:
    return separated_list(any_value(depth - 1), "\\[", "\\]")


def any_object(depth: int) -> str:
    return separated_list(f"{STRING}: {any_value(depth - 1)}", "\\{", "\\}")


def separated_list(item: str, open_: str, close: str, lo: int = 0, hi: int | None = None) -> str:
    """open item (, item)* close，lo ≤ 项数 ≤ hi。item 包在 (?:...) 里：automaton.py 认出 "X(?:, X)*"，
    只造一个 X（不限项数时）。"""
    if hi == 0:
        return open_ + close
    body = f"(?:{item})(?:, (?:{item})){{{max(lo - 1, 0)},{'' if hi is None else hi - 1}}}"
    return f"{open_}{body}{close}" if lo > 0 else f"{open_}(?:{body})?{close}"


def json_object_regex(max_depth: int = DEFAULT_MAX_DEPTH) -> str:
    """response_format={"type": "json_object"}：任意 JSON 对象（外层算一层）。"""
    return any_object(max_depth)


def schema_to_regex(schema, max_depth: int = DEFAULT_MAX_DEPTH) -> str:
    """schema（dict 或 JSON 文本）→ 正则。不支持的内容报 GrammarError，信息里有关键字的名字与它在 schema 里的位置。"""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise GrammarError(f"JSON schema is not valid JSON: {e}") from None
    return _Converter(schema, max_depth).convert(schema, "#", ())


class _Converter:
    def __init__(self, root, max_depth: int):
        self.root, self.max_depth = root, max_depth

    def error(self, where: str, msg: str):
        return GrammarError(f"JSON schema at {where}: {msg}")

    def convert(self, s, where: str, refs: tuple) -> str:
        """refs：正在展开的 $ref 链，用来发现递归。"""
        if s is True or s == {}:
            return any_value(self.max_depth)
        if not isinstance(s, dict):
            raise self.error(where, f"a schema must be an object or true, got {json.dumps(s)}")
        types = s.get("type")
        if types is None:                         # 没写 type：从关键字推断（收窄），推断不出就是任意值
            types = [t for t, keys in BY_TYPE.items() if keys & s.keys()][:1] or None
        if isinstance(types, str):
            types = [types]
        if types is not None and (not isinstance(types, list) or not types or
                                  any(t not in BY_TYPE for t in types)):
            raise self.error(where, f"unsupported type {json.dumps(s['type'])}")
        allowed = COMMON | set().union(*(BY_TYPE[t] for t in types or ()))
        for k in s:
            if k not in allowed:
                other_type = any(k in keys for keys in BY_TYPE.values())
                raise self.error(where, f"unsupported keyword {k!r}" +
                                 (f" for type {'/'.join(types or ['any'])}" if other_type else ""))

        if "$ref" in s:
            return self.ref(s, where, refs)
        if "const" in s or "enum" in s:
            return self.enum(s, types, where)
        if "anyOf" in s:
            others = [k for k in s if k not in {"anyOf", "$defs", "definitions"} | ANNOTATIONS]
            if others:
                raise self.error(where, f"anyOf combined with {others[0]!r} is not supported")
            if not isinstance(s["anyOf"], list) or not s["anyOf"]:
                raise self.error(where, "anyOf must be a non-empty list")
            return group([self.convert(sub, f"{where}/anyOf/{i}", refs) for i, sub in enumerate(s["anyOf"])])
        if types is None:
            return any_value(self.max_depth)
        return group([self.typed(t, s, where, refs) for t in types])

    def ref(self, s, where: str, refs: tuple) -> str:
        ref = s["$ref"]
        others = [k for k in s if k not in {"$ref", "$defs", "definitions"} | ANNOTATIONS]
        if others:
            raise self.error(where, f"$ref combined with {others[0]!r} is not supported")
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise self.error(where, f"only local $ref ('#/...') is supported, got {json.dumps(ref)}")
        if ref in refs:
            raise self.error(where, f"recursive $ref {ref!r} is not supported (a regular language cannot nest "
                                    "without bound)")
        target = self.root
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(target, dict) and part in target:
                target = target[part]
            elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
                target = target[int(part)]
            else:
                raise self.error(where, f"$ref {ref!r} points to nothing")
        return self.convert(target, ref, refs + (ref,))

    def enum(self, s, types, where: str) -> str:
        others = [k for k in s if k not in {"enum", "const", "type", "$defs", "definitions"} | ANNOTATIONS]
        if others:
            raise self.error(where, f"enum/const combined with {others[0]!r} is not supported")
        values = [s["const"]] if "const" in s else s["enum"]
        if "const" in s and "enum" in s or not isinstance(values, list) or not values:
            raise self.error(where, "enum must be a non-empty list (and not combined with const)")
        if types is not None:
            values = [v for v in values if json_type(v) in types or (json_type(v) == "integer" and "number" in types)]
            if not values:
                raise self.error(where, f"no enum/const value has type {'/'.join(types)}")
        return group([literal(dump(v)) for v in values])

    def typed(self, t: str, s, where: str, refs: tuple) -> str:
        if t == "object":
            return self.object(s, where, refs)
        if t == "array":
            return self.array(s, where, refs)
        if t == "string":
            return self.string(s, where)
        return SCALARS[t]

    def object(self, s, where: str, refs: tuple) -> str:
        props = s.get("properties")
        if s.get("additionalProperties", False) is not False:
            raise self.error(where, "unsupported keyword 'additionalProperties' (only false is supported)")
        if props is None:
            if "required" in s:
                raise self.error(where, "'required' without 'properties' is not supported")
            return "\\{\\}" if "additionalProperties" in s else any_object(self.max_depth)
        if not isinstance(props, dict):
            raise self.error(where, "properties must be an object")
        required = s.get("required", [])
        if not isinstance(required, list) or any(r not in props for r in required):
            missing = [r for r in required if r not in props] if isinstance(required, list) else required
            raise self.error(where, f"required must list declared properties, got {json.dumps(missing)}")
        items = [(literal(dump(name)) + ": " + self.convert(sub, f"{where}/properties/{name}", refs),
                  name in required) for name, sub in props.items()]
        return "\\{" + _properties(items) + "\\}"

    def array(self, s, where: str, refs: tuple) -> str:
        item = self.convert(s["items"], f"{where}/items", refs) if "items" in s else any_value(self.max_depth - 1)
        lo, hi = _bounds(s, "minItems", "maxItems", where, self.error)
        return separated_list(item, "\\[", "\\]", lo, hi)

    def string(self, s, where: str) -> str:
        if "pattern" in s:
            if "minLength" in s or "maxLength" in s:
                raise self.error(where, "pattern combined with minLength/maxLength is not supported")
            if not isinstance(s["pattern"], str):
                raise self.error(where, "pattern must be a string")
            return '"' + to_regex(parse_regex(s["pattern"], json_string=True)) + '"'
        lo, hi = _bounds(s, "minLength", "maxLength", where, self.error)
        if (lo, hi) == (0, None):
            return STRING
        return f'"{STRING_CHAR}{{{lo},{"" if hi is None else hi}}}"'


def _properties(items: list[tuple[str, bool]]) -> str:
    """按声明顺序的属性，可选的可以省略；第一个出现的前面没有逗号。从后往前拼：
    after = 这一个及以后、前面已经有属性时的正则（每个可选属性只是 "(?:, 它)?"，线性长度）；
    first = 同样、但前面还没有属性：要么它是第一个，要么它缺席、第一个在后面（平方长度，不是指数）。"""
    after, first = "", ""
    for text, req in reversed(items):
        present = text + after
        first = present if req else f"(?:{present}|{first})" if first else f"(?:{present})?"
        after = (f", {text}" if req else f"(?:, {text})?") + after
    return first


def _bounds(s, lo_key: str, hi_key: str, where: str, error) -> tuple[int, int | None]:
    lo, hi = s.get(lo_key, 0), s.get(hi_key)
    for k, v in ((lo_key, lo), (hi_key, hi)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0 or v > 1000):
            raise error(where, f"{k} must be an integer in [0, 1000], got {json.dumps(v)}")
    if hi is not None and hi < lo:
        raise error(where, f"{lo_key} {lo} is greater than {hi_key} {hi}")
    return lo, hi


def json_type(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    return {float: "number", str: "string", list: "array", dict: "object"}[type(v)]
