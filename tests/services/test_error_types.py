"""ErrorInfo.type is one closed set (schemas/errors.py's ErrorType): every typed error's
`type`, and the stream-end types no exception carries. A type written anywhere in the code
that is not in the set, or an unknown type on the wire, is caught here."""

import re
from pathlib import Path

import msgspec
import pytest
from kvpager.schemas import errors
from kvpager.schemas.errors import ERROR_TYPES, STREAM_END_TYPES, KvpagerError
from kvpager.schemas.public import ErrorInfo
from kvpager.services.schema import public_schema

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("engine", "services", "schemas", "kvpager")
# ErrorInfo("<type>", ...), ErrorInfo(type="<type>") and a class body's `type = "<type>"`
WRITTEN_TYPE = re.compile(r'ErrorInfo\(\s*(?:type=)?"([a-z_]+)"|^\s*type = "([a-z_]+)"', re.M)


def _error_classes(cls=KvpagerError):
    return [cls] + [sub for child in cls.__subclasses__() for sub in _error_classes(child)]


def test_every_error_class_type_is_listed():
    import kvpager.services.cli  # noqa: F401  # the services' own subclasses too

    for cls in _error_classes():
        assert cls.type in ERROR_TYPES, cls


def test_every_type_written_in_the_code_is_listed():
    written = set()
    for folder in SOURCES:
        for path in (ROOT / folder).rglob("*.py"):
            for match in WRITTEN_TYPE.finditer(path.read_text()):
                written.add(match.group(1) or match.group(2))
    assert written, "the pattern found no error types: it is out of date"
    assert written <= set(ERROR_TYPES), written - set(ERROR_TYPES)
    assert set(STREAM_END_TYPES) <= written  # each is used, so each is listed for a reason


def test_every_error_class_is_raised_somewhere():
    """A class nothing raises is dead code (MigrationLimitError was)."""
    code = "\n".join(
        path.read_text() for folder in SOURCES for path in (ROOT / folder).rglob("*.py")
    )
    for name, cls in vars(errors).items():
        if isinstance(cls, type) and issubclass(cls, KvpagerError) and cls is not KvpagerError:
            assert f"raise {name}(" in code, name


def test_an_unknown_type_is_refused_on_the_wire():
    good = msgspec.json.encode(ErrorInfo("overloaded", "later"))
    assert msgspec.json.decode(good, type=ErrorInfo).type == "overloaded"
    bad = good.replace(b"overloaded", b"overload")
    with pytest.raises(msgspec.ValidationError, match="Invalid enum value"):
        msgspec.json.decode(bad, type=ErrorInfo)


def test_the_schema_shows_the_enum():
    field = public_schema()["$defs"]["ErrorInfo"]["properties"]["type"]
    assert sorted(field["enum"]) == sorted(ERROR_TYPES)
