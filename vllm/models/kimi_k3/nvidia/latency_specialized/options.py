"""`BackendOptions`: this backend's keys of vLLM's `additional_config`.

    --additional-config '{"decode_backend": "latency_specialized", "allow_unvalidated": true}'

| key | values | meaning |
|---|---|---|
| `decode_backend` | `"auto"` (default), `"latency_specialized"` | `auto`: the standard path exactly as without this backend |
| `strict_scope` | `false` (default), `true` | out of scope: raise at start-up instead of falling back |
| `allow_unvalidated` | `false` (default), `true` | also admit `declared` envelopes (logged as a warning) |

Any other key, or a value outside these, is refused with a `ValueError` listing what
this backend accepts: a typo must not silently leave the backend off.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Mapping

DECODE_BACKENDS = ("auto", "latency_specialized")
_BOOL_KEYS = ("strict_scope", "allow_unvalidated")
ACCEPTED_KEYS = ("decode_backend",) + _BOOL_KEYS

_WHO = "the Kimi K3 latency_specialized decode backend"


@dataclass(frozen=True)
class BackendOptions:
    decode_backend: str = "auto"
    strict_scope: bool = False
    allow_unvalidated: bool = False

    def __post_init__(self) -> None:
        if self.decode_backend not in DECODE_BACKENDS:
            raise ValueError(
                f"additional_config['decode_backend'] = {self.decode_backend!r} is not a value "
                f"{_WHO} accepts; use 'auto' (the standard path, unchanged) or "
                "'latency_specialized'"
            )
        for key in _BOOL_KEYS:
            value = getattr(self, key)
            if not isinstance(value, bool):
                raise ValueError(
                    f"additional_config['{key}'] must be true or false (a JSON boolean), "
                    f"found {type(value).__name__} {value!r}"
                )
            if value and self.decode_backend == "auto":
                raise ValueError(
                    f"additional_config['{key}'] = true has no effect with decode_backend "
                    "'auto' (the backend is off); set decode_backend to 'latency_specialized' "
                    f"or drop '{key}'"
                )

    @classmethod
    def parse(cls, config: Mapping[str, Any] | None) -> "BackendOptions":
        """vLLM's `additional_config` (already parsed from JSON) -> `BackendOptions`."""
        if config is None:
            return cls()
        if not isinstance(config, Mapping):
            raise ValueError(
                f"additional_config must be a mapping (a JSON object), found "
                f"{type(config).__name__} {config!r}"
            )
        for key in config:
            if key not in ACCEPTED_KEYS:
                close = difflib.get_close_matches(str(key), ACCEPTED_KEYS, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ValueError(
                    f"additional_config: unknown key {key!r}{hint}; {_WHO} accepts only the "
                    f"keys {', '.join(ACCEPTED_KEYS)}"
                )
        return cls(**dict(config))

    @property
    def requested(self) -> bool:
        """Whether the operator asked for the specialized backend at all."""
        return self.decode_backend == "latency_specialized"
