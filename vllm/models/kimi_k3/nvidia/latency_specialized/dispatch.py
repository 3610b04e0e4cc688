"""`Dispatcher`: the start-up verdict, the per-step route, and `PathCounters`.

At start-up the deployment is matched against SCOPE.yaml once and the verdict logged
once, in one line: ON with the envelope and its limits (a warning when it is only
`declared` and admitted through `allow_unvalidated`), or OFF with every unmet
requirement. With `strict_scope` an out-of-scope deployment raises `ScopeError` instead.
With `decode_backend='auto'` the dispatcher is inert: no scope is read, nothing is
logged above debug, and every step routes to the standard path, so behaviour is exactly
that of a build without this backend.

Per step, `route(step)` looks only at `StepFacts` (host-side integers every TP rank
holds identically), so every rank takes the same path. An admitted step goes to the
executor's `plan(step)`; until an executor exists (or when it declines a step) the
standard path serves it, and the route says so: the counters keep "admitted but served
standard" apart from out-of-envelope fall-backs, so no report can claim a speed-up the
specialized path did not deliver.

`PathCounters` count steps per path, standard-path steps per reason, and kernel
launches per name (recorded by the executor at plan / graph-replay time). Disabled
counters return at once from every record call.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Protocol

from .deployment import Deployment, StepFacts
from .options import BackendOptions
from .scope import Envelope, Scope, ScopeError, Verdict

LOGGER_NAME = "vllm.models.kimi_k3.nvidia.latency_specialized"
BACKEND_LOG = logging.getLogger(LOGGER_NAME)

SPECIALIZED = "specialized"
STANDARD = "standard"
AUTO_REASON = "decode_backend=auto"
OUT_OF_SCOPE_REASON = "deployment out of scope"
NOT_BUILT_REASON = "admitted; specialized executor not built"
DECLINED_REASON = "admitted; executor declined the step (plan returned None)"


class Executor(Protocol):
    def plan(self, step: StepFacts) -> Any | None: ...


@dataclass(frozen=True)
class Route:
    """Which path serves a step and why; `envelope` names the admitting envelope, if any."""

    path: str  # SPECIALIZED or STANDARD
    reason: str
    envelope: str | None = None
    plan: Any = field(default=None, compare=False, repr=False)

    @property
    def admitted(self) -> bool:
        return self.envelope is not None


class PathCounters:
    """Steps per path, standard-path steps per reason, kernel launches per name."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.steps: Counter[str] = Counter()
        self.admitted_on_standard = 0
        self.fallbacks: Counter[str] = Counter()
        self.kernels: Counter[str] = Counter()

    def record_route(self, route: Route) -> None:
        if not self.enabled:
            return
        self.steps[route.path] += 1
        if route.path == STANDARD:
            self.fallbacks[route.reason] += 1
            if route.admitted:
                self.admitted_on_standard += 1

    def record_kernels(self, names: Iterable[str]) -> None:
        """One launch per name given (repeat a name once per launch)."""
        if not self.enabled:
            return
        # a bare string would otherwise count its characters
        self.kernels.update((names,) if isinstance(names, str) else names)

    def reset(self) -> None:
        self.steps.clear()
        self.fallbacks.clear()
        self.kernels.clear()
        self.admitted_on_standard = 0

    @property
    def total_steps(self) -> int:
        return sum(self.steps.values())

    def as_dict(self) -> dict[str, Any]:
        return {
            "enabled": self.enabled,
            "steps": {SPECIALIZED: self.steps[SPECIALIZED], STANDARD: self.steps[STANDARD]},
            "admitted_on_standard": self.admitted_on_standard,
            "fallbacks": dict(self.fallbacks.most_common()),
            "kernels": dict(self.kernels.most_common()),
        }

    def summary(self) -> str:
        """One line for logs and `generate --stats`."""
        if not self.enabled:
            return "path counters off"
        line = (f"steps {self.total_steps}: specialized {self.steps[SPECIALIZED]}, standard "
                f"{self.steps[STANDARD]} (admitted but standard {self.admitted_on_standard})")
        if self.fallbacks:
            line += "; standard because: " + ", ".join(
                f"{reason} x{n}" for reason, n in self.fallbacks.most_common())
        if self.kernels:
            line += (f"; kernels: {sum(self.kernels.values())} launches of "
                     f"{len(self.kernels)} kernels")
        return line

    def table(self) -> str:
        """A multi-line table for `generate --stats`."""
        if not self.enabled:
            return "path counters off"
        rows: list[tuple[str, str]] = [("path", "steps")]
        rows += [(SPECIALIZED, str(self.steps[SPECIALIZED])), (STANDARD, str(self.steps[STANDARD])),
                 ("  of which admitted but standard", str(self.admitted_on_standard)),
                 ("", ""), ("standard path, by reason", "steps")]
        rows += [(reason, str(n)) for reason, n in self.fallbacks.most_common()] or [("(none)", "")]
        rows += [("", ""), ("kernel", "launches")]
        rows += [(name, str(n)) for name, n in self.kernels.most_common()] or [("(none)", "")]
        width = max(len(a) for a, _ in rows)
        num = max(len(b) for _, b in rows)
        body = [f"  {a:<{width}}  {b:>{num}}".rstrip() for a, b in rows]
        return "\n".join([f"path counters ({self.total_steps} steps)"] + body)


class Dispatcher:
    """Decides at start-up whether the backend is on, and per step which path serves."""

    def __init__(self, options: BackendOptions, deployment: Deployment,
                 scope: Scope | str | Path | None = None, executor: Executor | None = None,
                 log: logging.Logger = BACKEND_LOG,
                 counters: PathCounters | None = None, steps_at_max_model_len: bool = False) -> None:
        # steps_at_max_model_len: every step is routed at context max_model_len (vLLM's
        # captured graphs), so a max_model_len over the envelope's context admits none: OFF
        self.options = options
        self.deployment = deployment
        # set by the harness once the specialized executor is built
        self.executor = executor
        self.counters = counters if counters is not None else PathCounters()
        self.scope: Scope | None = None
        self.verdict: Verdict | None = None
        self.envelopes: tuple[Envelope, ...] = ()
        if not options.requested:
            self._fixed: Route | None = Route(STANDARD, AUTO_REASON)
            self.startup_line = "Kimi K3 decode: decode_backend=auto; the standard path serves every step"
            log.debug(self.startup_line)
            return
        self.scope = scope if isinstance(scope, Scope) else Scope.load(scope)
        self.verdict = self.scope.admits(deployment, options.allow_unvalidated, steps_at_max_model_len)
        if not self.verdict:
            if options.strict_scope:
                raise ScopeError(
                    "Kimi K3 latency_specialized decode: the deployment is out of scope "
                    f"({self.scope.path}) and strict_scope is set: {self.verdict.summary()}"
                )
            self._fixed = Route(STANDARD, OUT_OF_SCOPE_REASON)
            self.startup_line = ("Kimi K3 latency_specialized decode OFF, the standard path "
                                 f"serves every step: {self.verdict.summary()}")
            log.warning(self.startup_line)
            return
        self._fixed = None
        self.envelopes = self.verdict.envelopes
        d = deployment
        self.startup_line = (
            f"Kimi K3 latency_specialized decode ON for {d.gpu_label} tensor_parallel "
            f"{d.tensor_parallel}: "
            + "; ".join(f"envelope {e.name} ({e.limits()})" for e in self.envelopes)
            + "".join(f"; {w}" for w in self.verdict.warnings)
        )
        (log.warning if self.verdict.warnings else log.info)(self.startup_line)

    @property
    def enabled(self) -> bool:
        """Whether the specialized path may serve any step of this deployment."""
        return self._fixed is None

    def route(self, step: StepFacts) -> Route:
        route = self._fixed if self._fixed is not None else self._route_in_scope(step)
        self.counters.record_route(route)
        return route

    def _route_in_scope(self, step: StepFacts) -> Route:
        # envelopes of one deployment never overlap (scope.py refuses it): at most one admits
        refusals = []
        for env in self.envelopes:
            verdict = env.admits(step)
            if not verdict:
                refusals.append((env.name, verdict.reasons))
                continue
            if self.executor is None:
                return Route(STANDARD, NOT_BUILT_REASON, env.name)
            plan = self.executor.plan(step)
            if plan is None:
                return Route(STANDARD, DECLINED_REASON, env.name)
            return Route(SPECIALIZED, f"in envelope {env.name}", env.name, plan)
        if len(refusals) == 1:
            return Route(STANDARD, "; ".join(refusals[0][1]))
        return Route(STANDARD, "; ".join(f"{name}: {', '.join(r)}" for name, r in refusals))
