"""step15：正则 → 字节 DFA（对照 Python 的 re.fullmatch 与 UTF-8 解码器）、JSON schema → 正则（对照 jsonschema）。"""
import itertools
import json
import random
import re

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from step15_structured_output.automaton import DEAD, START, compile_regex, utf8_sequences
from step15_structured_output.regex_parser import GrammarError, char_set, parse_regex, to_regex
from step15_structured_output.schema import json_object_regex, schema_to_regex

# (正则, 枚举字符串用的字母表)：每个正则与 re.fullmatch(..., re.ASCII) 比较字母表上长度 ≤ 4 的全部字符串
REGEXES = [
    (r"[0-9]{3}-[0-9]{2}", "09-a"),
    (r"(a|bc)*d?", "abcd"),
    (r"(?:ab|a)+b{,2}", "ab"),
    (r"a{2,}|b{1,3}c", "abc"),
    (r"[^a-c]+é\d{2,3}", "aé1x\n"),
    (r".+", "a\n中é"),
    (r"\w+\s\W", "a_ \n-\r\x0b\x0c\x1c"),
    (r"\S\D*", " 1a\t"),
    (r"[]a-]x|[\]\-]", "]a-x\\"),
    (r"a{}|x{2}", "a{}x"),
    (r"[\u4e00-\u9fff]+[à-ÿ]?", "中文àÿa"),
    (r"你好|こんにちは|[😀-😂]", "你好こ😀😃"),
    (r"\x41\u00e9\.\*", "Aé.*"),
    (r"^(?:true|false|null)$", "truefals"),
    (r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?", "-0.19"),
    (r"(a?){3}b??", "ab"),
    (r"", "a"),
    (r"(?:a[^\s\S]|b)c|[^\d\D]*d", "abcd"),      # 空字符类：走不通的分支
]


def strings(alphabet: str, max_len: int = 4):
    for n in range(max_len + 1):
        for t in itertools.product(alphabet, repeat=n):
            yield "".join(t)


@pytest.mark.parametrize("rx, alphabet", REGEXES, ids=[r for r, _ in REGEXES])
def test_dfa_matches_python_re(rx, alphabet):
    dfa = compile_regex(rx)
    py = re.compile(rx, re.ASCII)
    wrong = [s for s in strings(alphabet) if dfa.fullmatch(s) != bool(py.fullmatch(s))]
    assert not wrong, wrong[:10]
    assert compile_regex(to_regex(parse_regex(rx))).num_states == dfa.num_states   # 打印回去再解析：同一个自动机


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_dfa_accepts_what_python_generates(data):
    """hypothesis 按正则生成匹配的字符串（含任意 Unicode）：DFA 都要接受。"""
    rx, _ = data.draw(st.sampled_from(REGEXES[:-1]))
    s = data.draw(st.from_regex(re.compile(rx, re.ASCII), fullmatch=True))
    assert compile_regex(rx).fullmatch(s), (rx, s)


# 随机正则：字面字符、字符类、.、分组、|、量词任意组合
ALPHABET = "ab中é\n"
atoms = st.sampled_from(["a", "b", "中", "é", ".", "[ab]", "[^a]", "[a-z]", "[中-龥]", r"\d", r"\W", r"\n", "[é-中]"])


def regex_strategy():
    def extend(inner):
        return st.one_of(
            st.tuples(inner, inner).map("".join),
            st.tuples(inner, inner).map(lambda p: f"{p[0]}|{p[1]}"),
            inner.map(lambda r: f"(?:{r})"),
            st.tuples(inner, st.sampled_from(["?", "*", "+", "{2}", "{0,2}", "{1,}", "{,1}"]))
              .map(lambda p: f"(?:{p[0]}){p[1]}"),
        )
    return st.recursive(atoms, extend, max_leaves=8)


@settings(max_examples=60, deadline=None)
@given(rx=regex_strategy())
def test_random_regexes_match_python_re(rx):
    dfa = compile_regex(rx)
    py = re.compile(rx, re.ASCII)
    wrong = [s for s in strings(ALPHABET) if dfa.fullmatch(s) != bool(py.fullmatch(s))]
    assert not wrong, (rx, wrong[:10])


def accepts_bytes(dfa, data: bytes) -> bool:
    return dfa.accepting[dfa.walk(START, data)]


def test_dot_is_exactly_one_valid_utf8_char():
    """. 在字节上：恰好接受一个合法 UTF-8 字符（换行除外）。对照 Python 的 UTF-8 解码器——它拒绝过长编码、
    代理码点、超过 U+10FFFF 的编码。1–2 个字节全部枚举，3–4 个字节随机抽样加上每个首字节的边界。"""
    dfa = compile_regex(".")

    def expected(data: bytes) -> bool:
        try:
            s = data.decode("utf-8")
        except UnicodeDecodeError:
            return False
        return len(s) == 1 and s != "\n"

    cases = [bytes([a]) for a in range(256)] + [bytes([a, b]) for a in range(256) for b in range(256)]
    rng = random.Random(0)
    for lead in range(0xE0, 0x100):
        for edge in (0x7F, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0):
            cases += [bytes([lead, edge, 0x80]), bytes([lead, edge, 0xBF, 0x80]), bytes([lead, 0x80, edge, 0xBF])]
        cases += [bytes([lead] + [rng.randrange(0x70, 0xD0) for _ in range(rng.choice((2, 3)))]) for _ in range(200)]
    wrong = [c for c in cases if accepts_bytes(dfa, c) != expected(c)]
    assert not wrong, [c.hex() for c in wrong[:10]]


@pytest.mark.parametrize("lo, hi", [(0, 0x10FFFF), (0x7F, 0x800), (0x7FF, 0x10000), (0xFFFF, 0x10FFFF),
                                     (0x1234, 0x5678), (0xD7F0, 0xE010), (0x10000, 0x3FFFF), (0xE9, 0xE9)])
def test_utf8_sequences_cover_exactly_the_range(lo, hi):
    """每个码点的编码恰好落在一条序列里，范围外的码点与代理码点不落在任何一条里（代理码点由 char_set 事先去掉）。"""
    seqs = [q for a, b in char_set([(lo, hi)]).ranges for q in utf8_sequences(a, b)]

    def hits(cp):
        data = chr(cp).encode("utf-8", "surrogatepass")
        return sum(len(s) == len(data) and all(a <= b <= c for b, (a, c) in zip(data, s)) for s in seqs)

    rng = random.Random(lo)
    inside = {lo, hi} | {rng.randint(lo, hi) for _ in range(3000)} | {b for b in (0x7F, 0x80, 0x7FF, 0x800, 0xFFFF,
                                                                                   0x10000) if lo <= b <= hi}
    outside = {c for c in (lo - 1, hi + 1, 0, 0x10FFFF) if 0 <= c <= 0x10FFFF and not lo <= c <= hi}
    outside |= {c for c in (0xD800, 0xDABC, 0xDFFF) if lo <= c <= hi}
    assert all(hits(c) == 1 for c in inside - outside if not 0xD800 <= c <= 0xDFFF)
    assert all(hits(c) == 0 for c in outside)


# (正则, Python re.error 报的位置)：我们的位置与它相同
BAD_REGEXES = [("(ab", 0), ("ab)", 2), ("*a", 0), ("a**", 2), ("[ab", 0), ("[z-a]", 1), ("a{3,2}", 2),
               ("a\\", 1), ("(?:a|b", 0), ("x|+", 2)]


@pytest.mark.parametrize("rx, pos", BAD_REGEXES, ids=[r for r, _ in BAD_REGEXES])
def test_invalid_regex_names_the_position_like_python(rx, pos):
    with pytest.raises(re.error) as py:
        re.compile(rx)
    assert py.value.pos == pos
    with pytest.raises(GrammarError, match=f"at position {pos}$"):
        parse_regex(rx)


@pytest.mark.parametrize("rx, what", [("(?=a)b", "unsupported group syntax"), (r"(a)\1", r"unsupported escape \\1"),
                                      (r"\bword", r"unsupported escape \\b"), ("a^b", "only supported at the start"),
                                      ("a$b", "only supported at the start"), (r"\x4", "bad escape"),
                                      ("a{1001}", "repeat count over 1000"), ("(?P<n>a)", "unsupported group"),
                                      (r"a[^\s\S]", "matches no string")])
def test_unsupported_regex_syntax_is_refused(rx, what):
    with pytest.raises(GrammarError, match=re.escape(what) if "\\" not in what else what):
        compile_regex(rx)


def test_dead_states_are_pruned():
    r"""剪枝之后：除 DEAD 外每个状态都能走到接受状态（掩码只看"走完 token 后是否还活着"靠的就是它）。
    [^\s\S] 是空集：子集构造给 "a" 之后一个非空的 NFA 状态集合，它却永远到不了接受状态，必须并进 DEAD。"""
    dfa = compile_regex(r'"(?:[^"\\]|\\.)*"|[0-9]{2,4}|(?:ab|ac)d|xa[^\s\S]')
    assert dfa.walk(START, b"xa") == DEAD
    reach = {s for s in range(dfa.num_states) if dfa.accepting[s]}
    changed = True
    while changed:
        new = {s for s in range(dfa.num_states) if any(t in reach for t in dfa.trans[s])}
        changed = not new <= reach
        reach |= new
    assert reach == set(range(1, dfa.num_states))
    assert dfa.trans[DEAD] == [DEAD] * 256 and not dfa.accepting[DEAD]


# ---------------------------------------------------------------- JSON schema → 正则

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                      "city": {"enum": ["Paris", "北京", "Zürich"]}},
     "required": ["name", "age", "city"]},
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 3},
                                      "c": {"type": "boolean"}, "d": {"type": "null"}}, "required": ["c"]},
    {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}}},
    {"type": "array", "items": {"type": "object", "properties": {"id": {"type": "integer"},
                                                                 "tags": {"type": "array", "items": {"type": "string"},
                                                                          "minItems": 1, "maxItems": 2}},
                                "required": ["id", "tags"], "additionalProperties": False}, "maxItems": 3},
    {"$defs": {"pt": {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                      "required": ["lat", "lon"]}},
     "type": "object", "properties": {"from": {"$ref": "#/$defs/pt"}, "to": {"$ref": "#/$defs/pt"},
                                      "via": {"anyOf": [{"$ref": "#/$defs/pt"}, {"type": "null"}]}},
     "required": ["from", "to"]},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                                      "word": {"type": "string", "pattern": "[a-z\"]+"},
                                      "kind": {"const": "x\"y\\z"}, "level": {"type": ["integer", "null"]}},
     "required": ["code", "word", "kind", "level"], "title": "annotations are fine", "description": "..."},
    {"type": "string", "minLength": 2, "maxLength": 4},
    {"enum": [1, "one", None, True, [1, 2], {"k": "v"}]},
    {"type": "object", "properties": {"any": {}, "obj": {"type": "object"}, "arr": {"type": "array"}},
     "required": ["any", "obj", "arr"]},
]


def random_walk(dfa, rng: random.Random, max_bytes: int = 120, live_cache=None) -> bytes | None:
    """沿 DFA 随机走，每到一个接受状态以 1/3 的概率停下；超过 max_bytes 还没停返回 None。"""
    live_cache = {} if live_cache is None else live_cache
    s, out = START, bytearray()
    while len(out) < max_bytes:
        if dfa.accepting[s] and rng.random() < 1 / 3:
            return bytes(out)
        if s not in live_cache:
            live_cache[s] = [b for b in range(256) if dfa.trans[s][b] != DEAD]
        if not live_cache[s]:
            return bytes(out)
        b = rng.choice(live_cache[s])
        out.append(b)
        s = dfa.trans[s][b]
    return None


def compact(text: str) -> bool:
    """字符串之外的空白只有 ", " 与 ": " 里的那一个空格。"""
    in_string, escaped = False, False
    for i, c in enumerate(text):
        if in_string:
            in_string, escaped = (escaped or c != '"'), (not escaped and c == "\\")
        elif c == '"':
            in_string = True
        elif c.isspace() and not (c == " " and text[i - 1] in ",:" and not text[i + 1].isspace()):
            return False
    return True


@pytest.mark.parametrize("schema", SCHEMAS, ids=[f"schema{i}" for i in range(len(SCHEMAS))])
def test_schema_regex_generates_only_valid_json(schema):
    """沿 DFA 随机走出来的每个完整输出：是合法 UTF-8、json.loads 得了、满足 schema（jsonschema 判）、且是紧凑格式。"""
    dfa = compile_regex(schema_to_regex(schema))
    validator = jsonschema.Draft202012Validator(schema)
    rng = random.Random(0)
    done = 0
    live = {}
    for _ in range(400):
        out = random_walk(dfa, rng, live_cache=live)
        if out is None:
            continue
        text = out.decode("utf-8")
        validator.validate(json.loads(text))
        assert compact(text), text
        done += 1
    assert done >= 50


@pytest.mark.parametrize("schema, good, bad", [
    (SCHEMAS[1], [{"c": True}, {"a": 1, "c": False}, {"a": -5, "b": "xyz", "c": True, "d": None}],
     [{}, {"a": 1}, {"c": True, "a": 1}, {"b": "long", "c": True}, {"c": True, "e": 1}]),
    (SCHEMAS[2], [{}, {"x": 1.5}, {"y": -0.0}, {"x": 1e-3, "y": 2}], [{"y": 1, "x": 2}, {"x": "1"}]),
    (SCHEMAS[3], [[], [{"id": 0, "tags": ["a"]}], [{"id": 1, "tags": ["a", "b"]}] * 3],
     [[{"id": 1, "tags": []}], [{"id": 1, "tags": ["a"]}] * 4, [{"tags": ["a"], "id": 1}]]),
    (SCHEMAS[5], [{"code": "AB-123", "word": "abc", "kind": "x\"y\\z", "level": None}],
     [{"code": "AB-1234", "word": "abc", "kind": "x\"y\\z", "level": 1}, {"code": "AB-123", "word": "a\"", "kind": "x\"y\\z", "level": 1}]),
    (SCHEMAS[8], [{"any": [1, {"a": None}], "obj": {"k": [[]]}, "arr": [{"a": []}]}],
     [{"any": [[[[]]]], "obj": {}, "arr": []}, {"any": 1, "obj": {"k": {"k": {"k": {"k": 1}}}}, "arr": []}]),
])
def test_schema_regex_accepts_valid_and_rejects_invalid(schema, good, bad):
    """good：满足 schema 的值，按紧凑格式写出来，DFA 都要接受；bad：不满足 schema（jsonschema 判），
    或者满足但超出我们的收窄（属性顺序、嵌套深度——从任意值开始的地方数 3 层、pattern 里要转义的字符），DFA 都要拒绝。"""
    dfa = compile_regex(schema_to_regex(schema))
    for v in good:
        jsonschema.validate(v, schema)
        assert dfa.fullmatch(json.dumps(v, ensure_ascii=False, separators=(", ", ": "))), v
    for v in bad:
        assert not dfa.fullmatch(json.dumps(v, ensure_ascii=False, separators=(", ", ": "))), v


def test_json_object_is_any_object_up_to_depth_3():
    dfa = compile_regex(json_object_regex())
    rng = random.Random(1)
    seen = 0
    for _ in range(100):
        out = random_walk(dfa, rng, max_bytes=200)
        if out is not None:
            assert isinstance(json.loads(out), dict)
            seen += 1
    assert seen > 20
    for text, ok in [('{}', True), ('{"a": [{"b": 1}]}', True), ('{"a": [[1]]}', True), ('{"a": [[[1]]]}', False),
                     ('[]', False), ('{"a":1}', False), ('{"a": 1, "b": "x\\n\\u00e9"}', True), ('"s"', False)]:
        assert dfa.fullmatch(text) == ok, text


@pytest.mark.parametrize("schema, name", [
    ({"type": "integer", "minimum": 3}, "'minimum'"),
    ({"type": "string", "format": "date"}, "'format'"),
    ({"oneOf": [{"type": "integer"}]}, "'oneOf'"),
    ({"allOf": [{"type": "integer"}]}, "'allOf'"),
    ({"type": "array", "prefixItems": [{"type": "integer"}]}, "'prefixItems'"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": True},
     "'additionalProperties'"),
    ({"type": "object", "patternProperties": {"^a": {}}}, "'patternProperties'"),
    ({"type": "integer", "minLength": 1}, "'minLength' for type integer"),
    ({"type": "object", "properties": {"n": {"type": "number", "multipleOf": 2}}}, "#/properties/n: unsupported keyword 'multipleOf'"),
    ({"type": "object", "properties": {"n": {"$ref": "#"}}}, "recursive \\$ref"),
    ({"$ref": "#/$defs/missing"}, "points to nothing"),
    ({"type": "object", "properties": {"a": {}}, "required": ["b"]}, "required must list declared properties"),
    ({"type": "string", "pattern": "(a"}, "missing '\\)'"),
    ({"type": "string", "pattern": "a", "maxLength": 3}, "pattern combined with"),
    ({"type": "date"}, "unsupported type"),
    ({"enum": []}, "non-empty"),
    ({"type": "string", "enum": [1, 2]}, "no enum/const value has type string"),
    ({"type": "array", "maxItems": -1}, "maxItems must be an integer"),
    ('{"enum": [NaN]}', "is not valid JSON"),
    ("{not json", "JSON schema is not valid JSON"),
])
def test_unsupported_schema_is_refused_by_name(schema, name):
    with pytest.raises(GrammarError, match=name):
        schema_to_regex(schema)


def test_optional_properties_keep_order_and_commas():
    """三个可选属性的 8 种子集，每种按声明顺序写出来都接受；别的顺序、多余的逗号都拒绝。"""
    schema = {"type": "object", "properties": {k: {"type": "integer"} for k in "abc"}}
    dfa = compile_regex(schema_to_regex(schema))
    for n in range(4):
        for keys in itertools.combinations("abc", n):
            assert dfa.fullmatch(json.dumps({k: 1 for k in keys}, separators=(", ", ": ")))
    for text in ['{"b": 1, "a": 1}', '{, "a": 1}', '{"a": 1, }', '{"a": 1,"b": 1}', '{"a":1}', '{ }']:
        assert not dfa.fullmatch(text), text
