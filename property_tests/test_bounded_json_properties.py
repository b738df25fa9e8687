"""``bounded_json_loads``: untrusted metadata parses exactly as ``json.loads`` within the
bounds, and every document outside them is one named ``ValueError`` (never ``RecursionError``,
``OverflowError`` or a non-finite float)."""

import json
import math

from hypothesis import given
from hypothesis import strategies as st

from floatxq._checks import JSON_MAX_DEPTH, JSON_MAX_INT_DIGITS, bounded_json_loads

_LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**20), max_value=10**20)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(alphabet='ab[]{}"\\, :', max_size=8)
)
DOCUMENTS = st.recursive(
    _LEAVES,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=12,
)


def _depth(value: object) -> int:
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    return 0


@given(DOCUMENTS)
def test_documents_within_the_bounds_parse_as_json_does(doc):
    text = json.dumps(doc)
    assert bounded_json_loads(text, where="f.json") == json.loads(text)
    assert bounded_json_loads(text.encode(), where="f.json") == json.loads(text)


@given(st.integers(min_value=1, max_value=3 * JSON_MAX_DEPTH), st.sampled_from(["[]", "{}"]))
def test_nesting_beyond_the_bound_is_a_named_error(depth, brackets):
    opening, closing = brackets
    inner = '{"k": ' if opening == "{" else opening
    text = inner * depth + "1" + closing * depth
    try:
        value = bounded_json_loads(text, where="meta.json")
    except ValueError as err:
        assert depth > JSON_MAX_DEPTH and "meta.json: JSON nested deeper" in str(err)
    else:
        assert depth <= JSON_MAX_DEPTH and _depth(value) == depth


@given(st.integers(min_value=1, max_value=6000), st.booleans())
def test_long_integers_are_refused_by_length_never_overflowing(digits, negative):
    text = ("-" if negative else "") + "7" * digits
    try:
        value = bounded_json_loads(text, where="config.json")
    except ValueError as err:
        assert digits > JSON_MAX_INT_DIGITS and "config.json: an integer of" in str(err)
    else:
        assert digits <= JSON_MAX_INT_DIGITS and value == int(text)


@given(st.sampled_from(["NaN", "Infinity", "-Infinity", "1e309", "-2e400"]))
def test_non_finite_numbers_are_refused(literal):
    try:
        bounded_json_loads(f'{{"scale": {literal}}}', where="q.json")
    except ValueError as err:
        assert str(err).startswith("q.json: ")
    else:
        raise AssertionError(f"{literal} was accepted")


@given(st.floats(allow_nan=False, allow_infinity=False))
def test_finite_floats_round_trip(x):
    assert bounded_json_loads(json.dumps({"x": x}), where="f")["x"] == x and math.isfinite(x)
