"""Body field values read as vLLM reads them. Pure: no I/O, no pydantic.

vLLM's request models are pydantic v2 ``BaseModel``s validated in lax ("Python") mode from
the parsed JSON, so a field is not read by its JSON type: an ``int`` field takes ``2``,
``"2"``, ``" 2 "``, ``"1_0"``, ``2.0``, ``"2.0"`` and ``true`` (as 1), and refuses ``2.5``,
``"two"`` and ``null``; a ``bool`` field takes ``true``, ``"true"``, ``"yes"``, ``"on"``,
``"1"``, ``1``, ``1.0`` (and their false forms), and refuses ``"maybe"`` and ``2``. A proxy
that reads ``n: "2"`` as "not a count" disagrees with the engine that serves it.

This module mirrors those rules (``pdproxy.wire.body_fields`` applies them to the fields pdproxy
decides on):

* ``lax_int``, ``lax_bool``: pydantic's lax conversion, or ``FieldError`` with pydantic's
  own error type and message. ``tests/unit/test_coerce.py`` compares them with
  ``pydantic.TypeAdapter(...).validate_python`` on generated values, so the two cannot drift.
* ``read_int``, ``read_bool``: what a field means, for the decisions (decode alone, stream,
  text path); a value that would be refused reads as the field's default.

A real ``int``/``bool``/``None`` costs one type check; the parsing runs only for the rare
string or float.
"""

from __future__ import annotations

import math
import re
from typing import Any, TypeVar

# pydantic's error types and messages, as its ValidationError reports them.
INT_TYPE = ("int_type", "Input should be a valid integer")
INT_PARSING = (
    "int_parsing",
    "Input should be a valid integer, unable to parse string as an integer",
)
INT_PARSING_SIZE = (
    "int_parsing_size",
    "Unable to parse input string as an integer, exceeded maximum size",
)
INT_FROM_FLOAT = (
    "int_from_float",
    "Input should be a valid integer, got a number with a fractional part",
)
FINITE_NUMBER = ("finite_number", "Input should be a finite number")
BOOL_TYPE = ("bool_type", "Input should be a valid boolean")
BOOL_PARSING = ("bool_parsing", "Input should be a valid boolean, unable to interpret input")
STRING_TYPE = ("string_type", "Input should be a valid string")

_MAX_DIGITS = 4300  # CPython's int/str digit limit, which pydantic applies too
_I64_BOUND = 9.223372036854775808e18  # 2**63 as a float
_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1
# A JSON integer (what pydantic tries first): ASCII digits, no leading zero, no '+'.
_JSON_INT = re.compile(r"-?(?:0|[1-9][0-9]*)\Z")
_JSON_INT_DIGITS = re.compile(r"-?([1-9][0-9]*)")
# Rust's str::trim, which pydantic uses: Unicode White_Space (not Python's isspace).
_WHITESPACE = (
    "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008"
    "\u2009\u200a\u2028\u2029\u202f\u205f\u3000"
)
_TRUE_WORDS = frozenset({"1", "t", "y", "on", "yes", "true"})
_FALSE_WORDS = frozenset({"0", "f", "n", "no", "off", "false"})


class FieldError(ValueError):
    """A value the field's type refuses: ``kind`` is pydantic's error type."""

    def __init__(self, error: tuple[str, str]) -> None:
        super().__init__(error[1])
        self.kind, self.message = error


def lax_int(value: Any) -> int:
    """``value`` as pydantic's lax ``int`` reads it; raises ``FieldError``."""
    if type(value) is int:
        return value
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, str):
        return _int_from_text(value)
    if isinstance(value, float):
        return _int_from_float(value)
    if isinstance(value, int):  # an int subclass
        return int(value)
    raise FieldError(INT_TYPE)


def lax_bool(value: Any) -> bool:
    """``value`` as pydantic's lax ``bool`` reads it; raises ``FieldError``."""
    if value is True or value is False:
        return value
    if isinstance(value, str):
        # ASCII case folding only (Rust's eq_ignore_ascii_case), no whitespace trimming.
        word = value.lower() if value.isascii() else value
        if word in _TRUE_WORDS:
            return True
        if word in _FALSE_WORDS:
            return False
        raise FieldError(BOOL_PARSING)
    if isinstance(value, int):
        return _bool_from_int(value)
    if isinstance(value, float):
        if math.isfinite(value) and value.is_integer() and -_I64_BOUND < value < _I64_BOUND:
            return _bool_from_int(int(value))
        raise FieldError(BOOL_TYPE)
    raise FieldError(BOOL_TYPE)


def _bool_from_int(value: int) -> bool:
    if value in (0, 1):
        return value == 1
    raise FieldError(BOOL_PARSING if _I64_MIN <= value <= _I64_MAX else BOOL_TYPE)


def _int_from_float(value: float) -> int:
    if not math.isfinite(value):
        raise FieldError(FINITE_NUMBER)
    if not value.is_integer():
        raise FieldError(INT_FROM_FLOAT)
    if -_I64_BOUND < value < _I64_BOUND:
        return int(value)
    raise FieldError(INT_PARSING_SIZE)


def _int_from_text(text: str) -> int:
    """pydantic's ``str`` → ``int``: a JSON integer as it is (past 4,300 digits: "exceeded
    maximum size"), else the text cleaned (trimmed, one sign, leading zeros, a ``.0…``
    fraction and single inner underscores dropped) and parsed again."""
    lead = _JSON_INT_DIGITS.match(text)
    if lead is not None and len(lead.group(1)) > _MAX_DIGITS:
        raise FieldError(INT_PARSING_SIZE)
    if _JSON_INT.match(text):
        return _decimal(text, INT_PARSING_SIZE)
    cleaned = _clean_int_text(text)
    if cleaned is None or not _JSON_INT.match(cleaned):
        raise FieldError(INT_PARSING)
    lead = _JSON_INT_DIGITS.match(cleaned)
    if lead is not None and len(lead.group(1)) > _MAX_DIGITS:
        raise FieldError(INT_PARSING)
    return _decimal(cleaned, INT_PARSING)


def _decimal(text: str, too_long: tuple[str, str]) -> int:
    try:
        return int(text)
    except ValueError:  # a process that lowered CPython's digit limit below 4,300
        raise FieldError(too_long) from None


def _clean_int_text(text: str) -> str | None:
    """The text pydantic parses again after a first failure, or None when nothing changed."""
    s = text.strip(_WHITESPACE)
    if s.startswith("+"):
        if s[1:2] == "-":
            return None
        s = s[1:]
    sign = ""
    if s.startswith("-"):
        if s[1:2] in ("-", "+"):
            return None
        sign, s = "-", s[1:]
    stripped = _strip_leading_zeros(s)
    if stripped is None:
        return None
    s = stripped
    dot = s.find(".")
    if dot >= 0 and len(s) > dot + 1 and s[dot + 1 :].strip("0") == "":
        s = s[:dot]
    if "_" in s and not (s.startswith("_") or s.endswith("_") or "__" in s):
        return sign + s.replace("_", "")
    if len(s) == len(text):
        return None
    return sign + s


def _strip_leading_zeros(s: str) -> str | None:
    """Leading zeros (and underscores among them) dropped, one kept before a point or at
    the end; None when the text cannot start a number."""
    if not s or (s[0] != "0" and s[0] not in "123456789-"):
        return None
    if s[0] != "0":
        return s
    for i in range(1, len(s)):
        c = s[i]
        if c in "0_":
            continue
        if c in "123456789-":
            return s[i:]
        if c == ".":
            return s[i - 1 :]
        return None
    return s[-1:]


# -- reading a field for a decision ------------------------------------------------------


_Default = TypeVar("_Default", int, None)


def read_int(value: Any, default: _Default) -> int | _Default:
    """An int field's value (``default`` when absent, null or refused)."""
    if type(value) is int:
        return value
    if value is None:
        return default
    try:
        return lax_int(value)
    except FieldError:
        return default


def read_bool(value: Any, default: bool = False) -> bool:
    """A bool field's value (``default`` when absent, null or refused)."""
    if value is True or value is False:
        return value
    if value is None:
        return default
    try:
        return lax_bool(value)
    except FieldError:
        return default
