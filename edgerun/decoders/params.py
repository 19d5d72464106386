"""Strict reading of a decoder's ``[decoder.params]`` table from ``model.toml``.

Every decoder reads its parameters through ``ParamReader`` so that a typo or a
wrong type in a bundle fails when the model is loaded, with one line naming the
decoder, the key path and what was expected, instead of a ``KeyError`` or a
silent default at the first frame.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from edgerun.errors import ModelError

# Default meaning "no default": the getter raises when the key is missing.
REQUIRED: Any = object()


class ParamReader:
    """Typed getters over a params dict; ``finish()`` rejects keys nobody asked for."""

    def __init__(self, decoder_key: str, params: Mapping[str, Any]) -> None:
        self.decoder_key = decoder_key
        self._params = dict(params)
        self._seen: set[str] = set()

    def fail(self, name: str, message: str) -> ModelError:
        """A ModelError naming this decoder and ``decoder.params.<name>``."""
        return ModelError(f"{self.decoder_key}: decoder.params.{name}: {message}")

    def has(self, name: str) -> bool:
        return name in self._params

    def value(self, name: str, default: Any = REQUIRED) -> Any:
        """The raw value, for parameters whose type the caller checks itself."""
        return self._get(name, default)

    def _get(self, name: str, default: Any) -> Any:
        self._seen.add(name)
        if name in self._params:
            return self._params[name]
        if default is REQUIRED:
            raise self.fail(name, "is required")
        return default

    def integer(
        self, name: str, default: Any = REQUIRED, *, min_value: int | None = None, max_value: int | None = None
    ) -> int:
        value = self._get(name, default)
        # bool is an int subclass; `true` for a count is a mistake in the bundle, not 1.
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(name, f"expected an integer, got {value!r}")
        if min_value is not None and value < min_value:
            raise self.fail(name, f"must be >= {min_value}, got {value}")
        if max_value is not None and value > max_value:
            raise self.fail(name, f"must be <= {max_value}, got {value}")
        return value

    def number(
        self,
        name: str,
        default: Any = REQUIRED,
        *,
        min_value: float | None = None,
        max_value: float | None = None,
        positive: bool = False,
    ) -> float:
        value = self._get(name, default)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.fail(name, f"expected a number, got {value!r}")
        value = float(value)
        if math.isnan(value):
            raise self.fail(name, "must be a number, got NaN")
        if positive and value <= 0.0:
            raise self.fail(name, f"must be > 0, got {value}")
        if min_value is not None and value < min_value:
            raise self.fail(name, f"must be >= {min_value}, got {value}")
        if max_value is not None and value > max_value:
            raise self.fail(name, f"must be <= {max_value}, got {value}")
        return value

    def flag(self, name: str, default: Any = REQUIRED) -> bool:
        value = self._get(name, default)
        if not isinstance(value, bool):
            raise self.fail(name, f"expected true or false, got {value!r}")
        return value

    def choice(self, name: str, choices: tuple[str, ...], default: Any = REQUIRED) -> str:
        value = self._get(name, default)
        if not isinstance(value, str) or value not in choices:
            allowed = ", ".join(repr(c) for c in choices)
            raise self.fail(name, f"expected one of {allowed}, got {value!r}")
        return value

    def integers(self, name: str, default: Any = REQUIRED, *, min_value: int | None = None) -> tuple[int, ...]:
        value = self._get(name, default)
        if not isinstance(value, list | tuple) or any(isinstance(v, bool) or not isinstance(v, int) for v in value):
            raise self.fail(name, f"expected a list of integers, got {value!r}")
        if min_value is not None and any(v < min_value for v in value):
            raise self.fail(name, f"every value must be >= {min_value}, got {list(value)}")
        return tuple(value)

    def numbers(self, name: str, default: Any = REQUIRED) -> tuple[float, ...]:
        value = self._get(name, default)
        if not isinstance(value, list | tuple) or any(
            isinstance(v, bool) or not isinstance(v, int | float) for v in value
        ):
            raise self.fail(name, f"expected a list of numbers, got {value!r}")
        return tuple(float(v) for v in value)

    def finish(self) -> None:
        """Reject parameters that no getter consumed (typos, options of another decoder)."""
        unknown = sorted(set(self._params) - self._seen)
        if unknown:
            known = ", ".join(sorted(self._seen))
            raise ModelError(f"{self.decoder_key}: unknown decoder.params key(s) {', '.join(unknown)} (known: {known})")
