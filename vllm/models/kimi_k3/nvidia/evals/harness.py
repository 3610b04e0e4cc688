"""The eval harness: each task on the standard and the specialized path, compared, as evidence.

For every task × context length it generates greedily on both paths (the `Engine`, one
dispatcher per path: `decode_backend` auto vs latency_specialized with
`allow_unvalidated`), scores the outputs, and measures:

| figure | definition |
| --- | --- |
| accuracy ± SE | mean of the task's primary score (PRIMARY) per length per path; SE = sample std / √n |
| greedy agreement | positions where both paths emitted the same token / positions either emitted |
| yardstick agreement | the same for the rounding-noise yardstick (standard math, one bf16 rounding of noise per GEMM output) against the standard path, when it runs |
| logit divergence | teacher-forced on the standard path's output: per decode step max_v abs(Δ logit) and KL(softmax_std ‖ softmax_spec) |
| sampling parity | with temperature / top-k / top-p and a seed per run: per-step total variation between the two paths' filtered distributions, and the share of runs sampling identical tokens |

Gates, recorded as evidence `targets`: at every length the specialized path served decode
steps (else both sides ran the standard path and nothing was compared);
|acc_spec − acc_std| ≤ max(SE_std, 1 point); greedy agreement ≥ 99 % of tokens, or, with the
yardstick over at least `MIN_YARDSTICK_SAMPLES` samples, no lower than its agreement less two
standard errors of its own per-sample rates (a path's own scatter never lowers its bar);
teacher-forced KL ≤ `KL_BOUND` at every step (a skew that keeps the argmax passes agreement,
not this); per-step TV ≤ `TV_BOUND` and identical sampled runs ≥ `SAME_SAMPLES` of runs.

Why the yardstick: greedy generations fork at the first near-tie either path rounds the other
way, and every later token may follow, so agreement measures how many near-ties a task has as
much as how close two paths are. On the tiny model's MRCR and arithmetic (where it is often
unsure) the yardstick itself agrees on only 0.67–0.97 of tokens (H200, 6 samples per length);
a correct bf16 implementation cannot be held to 0.99 there, while a wrong one still falls
below the yardstick (and fails the logit and accuracy figures).

Prefill always runs the standard path, so divergence is measured on decode steps only.
Until the specialized executor exists the dispatcher admits the steps and the standard
path serves them (its honest fallback); the record's `paths_served` counts which path
served each step, so a record never claims a specialized run that did not happen. Once it
exists, pass `executor=` (its `plan(step)` admits steps) and `specialized=` (its decode
function `(ids, segments, state) -> logits`).
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence, TextIO

import torch

from ..latency_specialized.deployment import Deployment, StepFacts
from ..latency_specialized.dispatch import SPECIALIZED, Dispatcher, Executor
from ..latency_specialized.engine import Engine, Request
from ..latency_specialized.evidence import REPO_ROOT, write_record
from ..latency_specialized.options import BackendOptions
from ..latency_specialized.sampler import SamplingParams, filter_logits
from ..latency_specialized.tokenizer import ByteTokenizer
from ..reference.model import ReferenceModel
from .tasks import LENGTHS, PRIMARY, TASKS, primary_value, score, suite

TOK = ByteTokenizer()
PATHS = ("standard", "specialized")
YARDSTICK = "yardstick"
BACKENDS = {"standard": "auto", "specialized": "latency_specialized", YARDSTICK: "latency_specialized"}
ACCURACY_POINT = 0.01  # "1 point" of accuracy
GREEDY_AGREEMENT = 0.99
MIN_YARDSTICK_SAMPLES = 4  # below it the yardstick's scatter says too little to lower the bar
# nats, per teacher-forced step: the H200 records of the tiny model on the kernels peak at 7e-3
# (bf16 rounding); multiplying the logits by 3, which keeps every argmax, gives 2.3
KL_BOUND = 0.05
# bf16 kernels move logits by O(1e-2) at most on this model; that moves a filtered
# distribution by well under 2 % of its mass per step
TV_BOUND = 0.02
SAME_SAMPLES = 0.9

MODEL_DIR = Path(__file__).resolve().parents[1]
DecodeFn = Callable[[torch.Tensor, list, object], torch.Tensor]


class Progress:
    """A one-line progress bar on stderr: `label [#####.....] k/n  12.3 s`."""

    def __init__(self, total: int, label: str = "eval", stream: TextIO | None = None,
                 enabled: bool | None = None, width: int = 30):
        self.total, self.label, self.width = max(1, total), label, width
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.done, self.t0 = 0, time.perf_counter()

    def advance(self, n: int = 1, label: str | None = None) -> None:
        self.done = min(self.total, self.done + n)
        if label is not None:
            self.label = label
        if not self.enabled:
            return
        filled = self.width * self.done // self.total
        bar = "#" * filled + "." * (self.width - filled)
        self.stream.write(f"\r{self.label} [{bar}] {self.done}/{self.total}  "
                          f"{time.perf_counter() - self.t0:.1f} s")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()


def default_deployment(max_model_len: int) -> Deployment:
    """This machine's deployment; without CUDA the H200 envelope's deployment, described."""
    common = dict(tp=1, max_model_len=max_model_len, expert_dtype="bfloat16")
    if torch.cuda.is_available():
        return Deployment.detect(**common)
    return Deployment.describe(gpu="H200", **common)


def dispatcher(path: str, deployment: Deployment, executor: Optional[Executor] = None) -> Dispatcher:
    if path not in BACKENDS:
        raise ValueError(f"unknown path {path!r}; the paths are {', '.join(BACKENDS)}")
    extra = {"decode_backend": BACKENDS[path]}
    if path != "standard":
        extra["allow_unvalidated"] = True
    return Dispatcher(BackendOptions.parse(extra), deployment, executor=executor)


@dataclass
class Paths:
    """The model, the deployment both paths see, one dispatcher per path (built once, so its
    start-up verdict is logged once and its counters cover the whole run), and the
    specialized decode function once the executor exists; `use_yardstick` adds a third path."""

    model: ReferenceModel
    deployment: Deployment
    specialized: Optional[DecodeFn] = None
    executor: Optional[Executor] = None  # plans the specialized steps (SpecializedDecode)
    served: dict[str, dict[str, int]] = field(default_factory=lambda: {p: {} for p in PATHS})
    yardstick: Optional[DecodeFn] = None  # set by use_yardstick

    def __post_init__(self) -> None:
        self.dispatchers = {p: dispatcher(p, self.deployment, self.executor if p == "specialized" else None)
                            for p in PATHS}

    def use_yardstick(self, executor) -> None:
        """Serve the `yardstick` path's decode steps with `executor` (a SpecializedDecode on
        RoundingNoiseOps), through its own dispatcher and counters."""
        self.yardstick = executor
        self.dispatchers[YARDSTICK] = dispatcher(YARDSTICK, self.deployment, executor)
        self.served[YARDSTICK] = {}

    def _decode(self, path: str) -> Optional[DecodeFn]:
        return {"specialized": self.specialized, YARDSTICK: self.yardstick}.get(path)

    def _own_state(self, path: str):
        """The DecodeState a non-standard path's decode function serves when it owns one (an
        executor: its graphs point at its pools), else None: a fresh state per run."""
        return getattr(self._decode(path), "state", None)

    def engine(self, path: str, requests: int, max_len: int) -> Engine:
        fn = self._decode(path)
        return Engine(self.model, dispatcher=self.dispatchers[path], specialized=fn,
                      max_requests=requests, max_len=max_len, state=self._own_state(path))

    def generate(self, path: str, requests: Sequence[Request]) -> list[list[int]]:
        longest = max(len(r.prompt_ids) + r.params.max_tokens for r in requests)
        eng = self.engine(path, len(requests), longest)
        outs = [c.output_ids for c in eng.generate(requests)]
        self._count(path, eng.stats.paths)
        return outs

    def _count(self, path: str, served: dict[str, int]) -> None:
        for k, v in served.items():
            self.served[path][k] = self.served[path].get(k, 0) + v

    @torch.no_grad()
    def teacher_forced(self, path: str, prompt: list[int], forced: list[int]) -> torch.Tensor:
        """Logits [len(forced), V] (fp32) predicting each forced token, feeding `forced` one a step.

        Row 0 comes from the prefill (the standard path's on both paths), row j ≥ 1 from the
        decode step that fed forced[j − 1], served by whichever path the dispatcher picks.
        """
        model, d, decode = self.model, self.dispatchers[path], self._decode(path)
        device = model.w.embed.device
        own = self._own_state(path)
        state = own if own is not None else model.new_state(max_requests=1, max_len=len(prompt) + len(forced),
                                                            device=device)
        r = state.allocate()
        served: dict[str, int] = {}
        try:
            seg = state.segment(r, 0, len(prompt), prefill=True)
            rows = [self._standard(torch.tensor(prompt, device=device), [seg], state)[-1].to(torch.float32).cpu()]
            for tok in forced[:-1]:
                seg = state.segment(r, 0, 1, prefill=False)
                route = d.route(StepFacts(rows=1, tokens_per_request=1, max_context=seg.pos0 + 1, pure_decode=True))
                use_spec = route.path == SPECIALIZED and decode is not None
                fn = decode if use_spec else self._standard
                rows.append(fn(torch.tensor([tok], device=device), [seg], state)[0].to(torch.float32).cpu())
                key = "specialized" if use_spec else "standard"
                served[key] = served.get(key, 0) + 1
        finally:
            state.free(r)  # the executor's state serves every later run
        self._count(path, served)
        return torch.stack(rows)

    def _standard(self, ids: torch.Tensor, segs: list, state) -> torch.Tensor:
        return self.model.logits(self.model.forward(ids, segs, state))


# ---------------------------------------------------------------------- figures


def mean_and_se(values: Sequence[float]) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, 0.0
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)


def token_agreement(a: Sequence[int], b: Sequence[int]) -> tuple[int, int]:
    """(positions with equal tokens, positions either sequence has)."""
    return sum(int(x == y) for x, y in zip(a, b)), max(len(a), len(b))


def agreement(outs: Sequence[list[int]], refs: Sequence[list[int]]) -> tuple[float, list[float], int]:
    """(token-weighted agreement of `outs` with `refs`, the per-sample rates, tokens counted)."""
    pairs = [token_agreement(a, b) for a, b in zip(refs, outs)]
    agreed, total = sum(x for x, _ in pairs), sum(y for _, y in pairs)
    return agreed / max(1, total), [x / max(1, y) for x, y in pairs], total


def agreement_floor(yard_rate: float, yard_rates: Sequence[float]) -> float:
    """The lowest agreement a path may show next to the yardstick: the yardstick's less two
    standard errors of its own per-sample rates (samples are the independent unit: within one,
    tokens after a fork follow it), and GREEDY_AGREEMENT where fewer than MIN_YARDSTICK_SAMPLES
    samples ran. The path's own rates take no part: scattering more would lower its bar."""
    if len(yard_rates) < MIN_YARDSTICK_SAMPLES:
        return GREEDY_AGREEMENT
    return yard_rate - 2 * mean_and_se(yard_rates)[1]


def logit_divergence(std: torch.Tensor, spec: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: max |Δ logit| and KL(softmax(std) ‖ softmax(spec)), both in fp64."""
    s, p = std.double(), spec.double()
    ls, lp = torch.log_softmax(s, -1), torch.log_softmax(p, -1)
    kl = (ls.exp() * (ls - lp)).sum(-1).clamp_min(0.0)
    return (s - p).abs().amax(-1), kl


def total_variation(std: torch.Tensor, spec: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Per row: ½ Σ |p_std − p_spec| of the sampler's filtered distributions (temperature, top-k, top-p)."""
    rows = []
    for a, b in zip(std, spec):
        pa = torch.softmax(filter_logits(a.double(), params), -1)
        pb = torch.softmax(filter_logits(b.double(), params), -1)
        rows.append(0.5 * (pa - pb).abs().sum())
    return torch.stack(rows) if rows else torch.zeros(0, dtype=torch.float64)


# ---------------------------------------------------------------------- runs


@dataclass(frozen=True)
class EvalSpec:
    tasks: tuple[str, ...] = ("mrcr", "kv", "arith")
    lengths: tuple[int, ...] = LENGTHS
    samples: int = 16
    seed: int = 0
    batch: int = 4  # requests per generate call
    logit_samples: int = 4  # samples per task × length that are teacher-forced on both paths
    slack: int = 16  # tokens a model may emit beyond the answer's length before it is cut off

    def __post_init__(self) -> None:
        unknown = [t for t in self.tasks if t not in TASKS]
        if unknown:
            raise ValueError(f"unknown task(s) {unknown}; the tasks are {', '.join(TASKS)}")
        for name in ("samples", "batch", "slack"):
            if getattr(self, name) < 1:
                raise ValueError(f"EvalSpec.{name} must be >= 1, found {getattr(self, name)}")
        if not self.lengths or min(self.lengths) < 1:
            raise ValueError(f"EvalSpec.lengths must be positive token counts, found {self.lengths}")


def run_tasks(paths: Paths, spec: EvalSpec, progress: Progress | None = None) -> tuple[list[dict], list[dict]]:
    """(results, targets) of the task evals, in the evidence format."""
    results, targets = [], []
    for task in spec.tasks:
        for length in spec.lengths:
            samples = suite(task, length, spec.samples, seed=spec.seed)
            outs: dict[str, list[list[int]]] = {}
            served_before = paths.served["specialized"].get("specialized", 0)
            for path in PATHS + ((YARDSTICK,) if paths.yardstick is not None else ()):
                outs[path] = []
                for i in range(0, len(samples), spec.batch):
                    chunk = samples[i:i + spec.batch]
                    reqs = [Request(s.prompt_ids, SamplingParams(max_tokens=len(s.answer_ids) + spec.slack,
                                                                 stop_token_ids=(TOK.EOS,))) for s in chunk]
                    outs[path] += paths.generate(path, reqs)
                    if progress:
                        progress.advance(len(chunk), f"{task} {length} {path}")
            acc = {}
            for path in PATHS:
                scores = [score(s, TOK.decode(o)) for s, o in zip(samples, outs[path])]
                values = [primary_value(s, sc) for s, sc in zip(samples, scores)]
                mean, se = mean_and_se(values)
                acc[path] = (mean, se)
                results.append({
                    "name": f"{task}@{length}/{path}", "status": "pass", "task": task, "length": length,
                    "path": path, "shape": {"context": length}, "n": len(samples), "metric": PRIMARY[task], "accuracy": mean, "stderr": se,
                    "exact": sum(sc.exact for sc in scores) / len(scores),
                    "similarity": sum(sc.similarity for sc in scores) / len(scores),
                })
            spec_steps = paths.served["specialized"].get("specialized", 0) - served_before
            agreed, rates, total = agreement(outs["specialized"], outs["standard"])
            floor, yard = GREEDY_AGREEMENT, {}
            if YARDSTICK in outs:
                y_agreed, y_rates, _ = agreement(outs[YARDSTICK], outs["standard"])
                floor = min(GREEDY_AGREEMENT, agreement_floor(y_agreed, y_rates))
                yard = {"yardstick_agreement": y_agreed}
            max_abs, kls = [], []
            for s, o in list(zip(samples, outs["standard"]))[:spec.logit_samples]:
                # row 0 is the prefill's, standard on both paths: compare decode steps only
                std = paths.teacher_forced("standard", s.prompt_ids, o)[1:]
                spc = paths.teacher_forced("specialized", s.prompt_ids, o)[1:]
                m, kl = logit_divergence(std, spc)
                max_abs += m.tolist()
                kls += kl.tolist()
                if progress:
                    progress.advance(1, f"{task} {length} logits")
            delta = acc["specialized"][0] - acc["standard"][0]
            allowed = max(acc["standard"][1], ACCURACY_POINT)
            acc_met, agree_met = abs(delta) <= allowed, agreed >= floor
            kl_max = max(kls, default=0.0)
            ran, kl_met = spec_steps > 0, kl_max <= KL_BOUND
            results.append({
                "name": f"{task}@{length}/parity",
                "status": "pass" if ran and acc_met and agree_met and kl_met else "fail", "specialized_steps": spec_steps,
                "task": task, "length": length, "accuracy_delta": delta, "greedy_agreement": agreed,
                **yard, "agreement_floor": floor, "greedy_tokens": total, "forced_steps": len(kls),
                "logit_max_abs": max(max_abs, default=0.0), "kl_mean": sum(kls) / max(1, len(kls)),
                "kl_max": kl_max,
            })
            targets.append({"name": f"{task}@{length} decode steps served by the specialized path",
                            "target": "> 0", "value": spec_steps, "met": ran})
            targets.append({"name": f"{task}@{length} accuracy, specialized vs standard",
                            "target": f"|delta| <= max(SE_standard, {ACCURACY_POINT})",
                            "value": delta, "allowed": allowed, "met": acc_met})
            targets.append({"name": f"{task}@{length} greedy token agreement",
                            "target": f">= {GREEDY_AGREEMENT}" if not yard else
                            f">= min({GREEDY_AGREEMENT}, yardstick's - 2 SE)",
                            "value": agreed, "allowed": floor, "met": agree_met})
            targets.append({"name": f"{task}@{length} teacher-forced KL, worst step",
                            "target": f"<= {KL_BOUND}", "value": kl_max, "met": kl_met})
    return results, targets


def default_sampling_params(runs: int, max_tokens: int = 12) -> list[SamplingParams]:
    """A spread of temperature / top-k / top-p settings, seeded 1..runs."""
    settings = [(1.0, 0, 1.0), (0.8, 40, 1.0), (0.7, 0, 0.9), (1.2, 20, 0.95)]
    return [SamplingParams(temperature=t, top_k=k, top_p=p, seed=1 + i, max_tokens=max_tokens)
            for i, (t, k, p) in ((i, settings[i % len(settings)]) for i in range(runs))]


def sampling_parity(paths: Paths, prompts: Sequence[list[int]], params: Sequence[SamplingParams],
                    progress: Progress | None = None) -> tuple[dict, list[dict]]:
    """(result, targets): per-step TV between the paths' sampling distributions, same-token runs.

    Run i samples prompts[i % len(prompts)] with params[i] on both paths (each path's
    Engine seeds the request's own generator, so equal logits give equal tokens); the
    distributions are compared teacher-forced on the standard path's sampled tokens.
    """
    if not prompts or not params:
        raise ValueError("sampling_parity needs at least one prompt and one SamplingParams")
    same, tvs, per_run = 0, [], []
    for i, p in enumerate(params):
        prompt = prompts[i % len(prompts)]
        std = paths.generate("standard", [Request(prompt, p)])[0]
        spc = paths.generate("specialized", [Request(prompt, p)])[0]
        tv = total_variation(paths.teacher_forced("standard", prompt, std)[1:],
                             paths.teacher_forced("specialized", prompt, std)[1:], p)
        same += int(std == spc)
        tvs += tv.tolist()
        per_run.append({"seed": p.seed, "temperature": p.temperature, "top_k": p.top_k, "top_p": p.top_p,
                        "identical": std == spc, "tv_max": max(tv.tolist(), default=0.0)})
        if progress:
            progress.advance(1, "sampling parity")
    tv_max = max(tvs, default=0.0)
    frac = same / len(params)
    result = {"name": "sampling parity", "status": "pass" if tv_max <= TV_BOUND and frac >= SAME_SAMPLES else "fail",
              "runs": len(params), "steps": len(tvs), "tv_max": tv_max, "tv_mean": sum(tvs) / max(1, len(tvs)),
              "identical_runs": frac, "per_run": per_run}
    targets = [{"name": "sampling: per-step total variation", "target": f"<= {TV_BOUND}", "value": tv_max,
                "met": tv_max <= TV_BOUND},
               {"name": "sampling: runs with identical tokens", "target": f">= {SAME_SAMPLES}", "value": frac,
                "met": frac >= SAME_SAMPLES}]
    return result, targets


def measured_sources(extra: Sequence[str | Path] = ()) -> list[str]:
    """Repo-relative sources the record depends on: this harness, the tasks, both decode paths."""
    def rel(p: Path) -> str:
        return str(p.resolve().relative_to(REPO_ROOT))

    files = [MODEL_DIR / "evals" / "harness.py", MODEL_DIR / "evals" / "tasks.py",
             MODEL_DIR / "latency_specialized" / "engine.py", MODEL_DIR / "latency_specialized" / "sampler.py",
             MODEL_DIR / "latency_specialized" / "dispatch.py"]
    files += sorted((MODEL_DIR / "reference").glob("*.py")) + sorted((MODEL_DIR / "kernels").glob("*.py"))
    # the executor and the op tables it runs (the kernels', the reference's, the yardstick's)
    files += [MODEL_DIR / "latency_specialized" / f for f in ("executor.py", "lanes.py", "decode_ops.py",
                                                              "torch_ops.py", "moe_padding.py")]
    out = [rel(f) for f in files]
    for p in extra:  # absolute, or relative to the repository (as `cli` shows paths inside it)
        path = Path(p) if Path(p).is_absolute() else REPO_ROOT / p
        path = path.resolve()
        if path.is_file() and REPO_ROOT in path.parents:
            out.append(rel(path))
    return sorted(set(out))


def evaluate(paths: Paths, spec: EvalSpec, *, out: str | Path | None = None, command: str = "",
             weights: str = "", parity_runs: int = 8, progress: bool | None = None) -> dict:
    """Run the task evals (and `parity_runs` sampling-parity runs); write the evidence to `out`."""
    runs = len(PATHS) + (paths.yardstick is not None)
    per_length = spec.samples * runs + min(spec.logit_samples, spec.samples)
    bar = Progress(len(spec.tasks) * len(spec.lengths) * per_length + parity_runs, enabled=progress)
    results, targets = run_tasks(paths, spec, bar)
    if parity_runs:
        prompts = [s.prompt_ids for s in suite("kv", min(spec.lengths), 4, seed=spec.seed + 1)]
        res, tg = sampling_parity(paths, prompts, default_sampling_params(parity_runs), bar)
        results.append(res)
        targets += tg
    bar.close()
    extra = {"model": paths.model.cfg.name, "weights": weights, "deployment": paths.deployment.summary(),
             "paths_served": paths.served, "specialized_built": paths.specialized is not None,
             "yardstick": paths.yardstick is not None,
             "dispatch": {p: d.counters.as_dict() for p, d in paths.dispatchers.items()},
             "startup": {p: d.startup_line for p, d in paths.dispatchers.items()},
             "spec": {"tasks": list(spec.tasks), "lengths": list(spec.lengths), "samples": spec.samples,
                      "seed": spec.seed, "logit_samples": spec.logit_samples, "slack": spec.slack}}
    if paths.specialized is None:
        extra["note"] = ("the specialized executor is not built: the dispatcher admitted the "
                         "specialized side's steps and the standard path served them")
    elif getattr(getattr(paths.specialized, "ops", None), "impl", None) == "reference":
        extra["note"] = ("the specialized executor served the specialized side with the reference ops "
                         "(no CUDA device): its step plumbing (buckets, padding rows, state commits) is "
                         "checked, not its kernels")
    record = {"kind": "eval", "family": "evals", "command": command, "results": results,
              "targets": targets, **extra}
    if out is not None:
        srcs = measured_sources([weights] if weights else [])
        record = write_record(out, "eval", "evals", command, srcs, results, targets, extra=extra)
    return record


def table(record: dict) -> str:
    """Accuracy ± SE per task × length × path, and the parity figures, as a Markdown table."""
    acc = {(r["task"], r["length"], r["path"]): r for r in record["results"] if "path" in r}
    par = {(r["task"], r["length"]): r for r in record["results"] if r["name"].endswith("/parity")}
    lines = ["| task | length | standard | specialized | greedy agreement (floor) | yardstick's | max abs(Δ logit) "
             "| mean KL | gates |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for (task, length), p in par.items():
        s, x = acc[(task, length, "standard")], acc[(task, length, "specialized")]
        yard = f"{p['yardstick_agreement']:.4f}" if "yardstick_agreement" in p else "not run"
        lines.append(f"| {task} | {length} | {s['accuracy']:.3f} ± {s['stderr']:.3f} | "
                     f"{x['accuracy']:.3f} ± {x['stderr']:.3f} | {p['greedy_agreement']:.4f} "
                     f"({p.get('agreement_floor', GREEDY_AGREEMENT):.3f}) | {yard} | "
                     f"{p['logit_max_abs']:.3g} | {p['kl_mean']:.3g} | {p['status']} |")
    for r in record["results"]:
        if r["name"] == "sampling parity":
            lines.append(f"\nsampling parity: {r['runs']} runs, {r['steps']} steps, max TV {r['tv_max']:.3g} "
                         f"(bound {TV_BOUND}), identical runs {r['identical_runs']:.2f} (gate {SAME_SAMPLES}): "
                         f"{r['status']}")
    if record.get("note"):
        lines.append(f"\nNote: {record['note']}.")
    return "\n".join(lines)
