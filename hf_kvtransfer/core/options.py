"""Parameter objects: a function's options as one frozen dataclass, each field still accepted as a keyword."""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any, TypeVar

T = TypeVar("T")


def with_options(cls: type[T], given: T | None, options: dict[str, Any], function: str) -> T:
    """`given` (default: `cls()`, the defaults) with the keyword `options` a caller gave `function` instead; an
    option that is not a field of `cls` is a one-line `TypeError` naming it."""
    unknown = sorted(set(options) - {f.name for f in fields(cls)})
    if unknown:
        raise TypeError(f"{function}() got unknown option(s) {', '.join(unknown)}; the options are {cls.__name__}'s fields")
    return replace(given if given is not None else cls(), **options)
