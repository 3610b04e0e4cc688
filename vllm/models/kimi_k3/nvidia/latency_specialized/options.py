"""`BackendOptions`: this backend's keys of vLLM's `additional_config`.

    --additional-config '{"decode_backend": "latency_specialized", "allow_unvalidated": true}'

| key | values | meaning |
|---|---|---|
| `decode_backend` | `"auto"` (default), `"latency_specialized"` | `auto`: the standard path exactly as without this backend |
| `strict_scope` | `false` (default), `true` | out of scope: raise at start-up instead of falling back |
| `allow_unvalidated` | `false` (default), `true` | also admit `declared` envelopes (logged as a warning) |

Any other key, or a value outside these, is refused with a `ValueError` listing what
this backend accepts: a typo must not silently leave the backend off. Under vLLM the
other keys are vLLM's own and pass through, except one that looks like a misspelling of
ours (`misspelt_key`): that one is refused too, for the same reason.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Mapping

DECODE_BACKENDS = ("auto", "latency_specialized")
_BOOL_KEYS = ("strict_scope", "allow_unvalidated")
ACCEPTED_KEYS = ("decode_backend",) + _BOOL_KEYS

_WHO = "the Kimi K3 latency_specialized decode backend"
# difflib ratio from which a key counts as ours misspelt: one letter off any of ours is
# above 0.9; vLLM's keys (moe_backend 0.8, kda_prefill_backend 0.6) stay below
NEAR_MISS = 0.85
# what a misspelt key, unread, leaves in place
_UNREAD = {"decode_backend": "the backend off", "strict_scope": "an out-of-scope deployment falling back "
           "instead of refused", "allow_unvalidated": "declared envelopes refused"}


def misspelt_key(key: Any) -> str | None:
    """Our key that `key` (not one of ours) looks like a misspelling of, or None.

    Case, '-' or ' ' for '_', and a letter or two off count; a key that holds one of ours
    as a whole '_'-separated part (vLLM's `kda_decode_backend`) is another component's.
    """
    if not isinstance(key, str):
        return None
    norm = key.strip().lower().replace("-", "_").replace(" ", "_")
    if norm in ACCEPTED_KEYS:
        return norm
    if any(norm.endswith("_" + k) or norm.startswith(k + "_") for k in ACCEPTED_KEYS):
        return None
    close = difflib.get_close_matches(norm, ACCEPTED_KEYS, n=1, cutoff=NEAR_MISS)
    return close[0] if close else None


def refuse_misspelt_keys(config: Mapping[Any, Any]) -> None:
    """Raise on a key of `config` that looks like one of ours misspelt: under vLLM it would
    pass through unread and leave the backend off, or not strict, silently."""
    for key in config:
        ours = misspelt_key(key) if key not in ACCEPTED_KEYS else None
        if ours is not None:
            raise ValueError(
                f"additional_config: key {key!r} is not a key of {_WHO} (did you mean {ours!r}?); "
                f"vLLM would ignore it, leaving {_UNREAD[ours]}: spell it {ours!r}. The backend's keys "
                f"are {', '.join(ACCEPTED_KEYS)}; vLLM's own keys (e.g. kda_decode_backend) pass through"
            )


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
                ours = misspelt_key(key)
                # not ours misspelt: vLLM's own, which nothing reads outside vLLM
                hint = f" (did you mean {ours!r}?)" if ours else ""
                unused = "" if ours else (
                    "; other keys are vLLM's own: under vLLM they pass through to it, but outside vLLM "
                    "(k3-decode, its evals) nothing reads them, so drop it")
                raise ValueError(
                    f"additional_config: unknown key {key!r}{hint}; {_WHO} accepts only the "
                    f"keys {', '.join(ACCEPTED_KEYS)}{unused}"
                )
        return cls(**dict(config))

    @property
    def requested(self) -> bool:
        """Whether the operator asked for the specialized backend at all."""
        return self.decode_backend == "latency_specialized"
