"""frontend/jsonwire.py against the standard library it stands in for: the same
value (types included) or the same exception for every body, and answers that
read back as the standard library's (key order, Chinese text, floats), with
NaN refused as before. Generated documents (hypothesis) and a corpus of the
awkward ones."""
from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings, strategies as st

from frontend import jsonwire

pytestmark = pytest.mark.skipif(not jsonwire.ENABLED, reason="orjson is off "
                                "(TEXTSWAP_JSON=stdlib or not installed)")


def outcome(fn, *args):
    """(kind, value) with types kept, or (exception type, message)."""
    try:
        v = fn(*args)
    except (ValueError, RecursionError, TypeError) as exc:
        return type(exc), str(exc)
    return "ok", typed(v)


def typed(v):
    """A value with every scalar's type beside it (1 and 1.0 and True differ)."""
    if isinstance(v, dict):
        return ("dict", [(k, typed(x)) for k, x in v.items()])  # key order kept
    if isinstance(v, list):
        return ("list", [typed(x) for x in v])
    if isinstance(v, float) and math.isnan(v):
        return ("float", "nan")
    if isinstance(v, float):
        return ("float", v, math.copysign(1.0, v))
    return (type(v).__name__, v)


def std_utf8(raw: bytes):
    return json.loads(raw.decode("utf-8"))


CORPUS = [
    b'{"text": "\xe8\xbf\x99\xe4\xb8\xaa\xe5\xa5\xbd"}', b'{"texts": ["a", "b"], "top_k": 2}',
    b'NaN', b'{"min_score": NaN}', b'{"min_score": Infinity}', b'-Infinity', b'1e400',
    b'\xef\xbb\xbf{"text": "x"}',                      # a UTF-8 BOM
    '{"text": "x"}'.encode("utf-16"), '{"t": 1}'.encode("utf-16-le"),
    b'{"text": "\xff\xfe"}', b'{"text": "\xed\xa0\x80"}',  # bad UTF-8, an encoded surrogate
    b'"\\ud800"', b'"\\udc00x"', b'"\\ud83d\\ude00"',    # lone and paired surrogate escapes
    b'123456789012345678901234567890', b'{"top_k": 100000000000000000000}',
    b'-9223372036854775809', b'18446744073709551616', b'9007199254740993',
    b'0.1000000000000000055511151231257827021181583404541015625', b'1e19', b'[1, {"a": 1e30}]',
    b'-0', b'-0.0', b'0.1', b'1E+2', b'2.5e-10', b'1.7976931348623157e308',
    b'{"a": 1, "a": 2}', b'{"b": 1, "a": 2}', b'[1,]', b'{"a": 1,}', b'01', b'.5', b'1.',
    b'"a\x01b"', b'"tab\tin"', b'\x0c{}', b' \t\n{}\r\n ', b'{}x', b'', b'   ',
    b'"\\u4e2d\\u6587"', b'"\\/"', b'"\\x"', b'[' * 5000 + b']' * 5000,
    b'[' * 100 + b']' * 100, b'{"a": [' * 50 + b'1' + b']}' * 50, b'true', b'null',
]


@pytest.mark.parametrize("raw", CORPUS)
def test_corpus_same_value_or_same_error(raw):
    assert outcome(jsonwire.loads_utf8, raw) == outcome(std_utf8, raw)
    assert outcome(jsonwire.loads, raw) == outcome(json.loads, raw)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda kids: st.lists(kids, max_size=5) | st.dictionaries(st.text(max_size=5), kids,
                                                               max_size=5),
    max_leaves=30)


@settings(max_examples=400, deadline=None)
@given(json_values)
def test_generated_documents_parse_alike(v):
    for raw in (json.dumps(v).encode(), json.dumps(v, ensure_ascii=False).encode("utf-8",
                                                                                  "surrogatepass")):
        assert outcome(jsonwire.loads_utf8, raw) == outcome(std_utf8, raw)
        assert outcome(jsonwire.loads, raw) == outcome(json.loads, raw)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=40) | st.text(alphabet='{}[]":,.-+eE0123456789 \\untrlaNIfiy\x00',
                                        max_size=30).map(str.encode))
def test_noise_parses_alike(raw):
    assert outcome(jsonwire.loads_utf8, raw) == outcome(std_utf8, raw)
    assert outcome(jsonwire.loads, raw) == outcome(json.loads, raw)


def std_dumps(obj):
    return json.dumps(obj, ensure_ascii=False, allow_nan=False).encode()


@settings(max_examples=400, deadline=None)
@given(json_values)
def test_answers_read_back_as_the_standard_librarys(v):
    got, want = outcome(jsonwire.dumps, v), outcome(std_dumps, v)
    assert got[0] == want[0]
    if got[0] == "ok":
        assert typed(json.loads(jsonwire.dumps(v))) == typed(json.loads(std_dumps(v)))


def test_an_answer_keeps_key_order_and_chinese_text_and_its_floats():
    answer = {"model": {"name": "情感", "version": 3, "labels": ["负面", "正面"], "replicas": 1},
              "predictions": [{"label": "正面", "score": 0.999968,
                               "top": [{"label": "正面", "score": 0.999968},
                                       {"label": "负面", "score": 3.2e-05}]}],
              "request_id": "r1"}
    out = jsonwire.dumps(answer)
    assert out.decode("utf-8").startswith('{"model":{"name":"情感","version":3,"labels":["负面"')
    assert "\\u" not in out.decode("utf-8")  # ensure_ascii=False: the text as it is
    assert b"0.000032" in out  # 3.2e-05 as orjson prints it (docs/benchmarks.md)
    back = json.loads(out)
    assert list(back) == ["model", "predictions", "request_id"]
    assert back == json.loads(std_dumps(answer))
    # control characters and U+2028 are written as the standard library writes them
    s = "a\x00\x1f\x7f\u2028b"
    assert jsonwire.dumps(s) == std_dumps(s)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_and_infinity_are_refused_as_before(bad):
    for obj in ({"score": bad}, [{"label": None, "score": bad}]):
        with pytest.raises(ValueError) as ours:
            jsonwire.dumps(obj)
        with pytest.raises(ValueError) as std:
            std_dumps(obj)
        assert str(ours.value) == str(std.value)
    assert jsonwire.dumps({"label": None, "score": 0.5}) == b'{"label":null,"score":0.5}'


@pytest.mark.parametrize("obj", [{"t": "\ud800"}, {1: "a"}, {"n": 2**70}, {"x": {1, 2}},
                                 [float("nan"), None]])
def test_what_orjson_cannot_write_goes_to_the_standard_library(obj):
    assert outcome(jsonwire.dumps, obj)[0] == outcome(std_dumps, obj)[0]
    if outcome(std_dumps, obj)[0] == "ok":
        assert jsonwire.dumps(obj) == std_dumps(obj)
