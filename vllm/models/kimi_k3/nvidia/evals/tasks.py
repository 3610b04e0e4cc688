"""Synthetic long-context tasks on the byte tokenizer, and their scores.

Each generator is a pure function of (length, seed): the same arguments give the same
sample on every machine (`random.Random` seeded with a string is platform-stable). The
prompt is exactly `length` tokens (BOS included); the answer is a single line, and its
ids end with EOS, the stop token the harness generates until.

| task | context | final query | answer | primary score |
| --- | --- | --- | --- | --- |
| `mrcr` | dialogue rounds `User: write a <kind> about <topic>` / `Bot: <text>`; every ask recurs | `User: repeat <kind> <n> about <topic>` | the exact text of the n-th earlier answer to that ask | MRCR's similarity |
| `kv` | lines `<key>=<value>` with the needles at chosen depths | `get <k1> <k2> ...:` | the needles' values, space-separated | exact match |
| `arith` | worked sums `a+b=c` | `a+b=` | the sum, digit by digit | exact match |

Arithmetic writes every number least-significant digit first, zero-padded to a fixed
width (operands `digits`, sum `digits + 1`), so the answer is produced in the order the
carries propagate; every query has at least one carry.

`practice` (training only) turns a fraction of the context into solved queries of the
same kind (MRCR repeat rounds, `get` lines) and marks their answers in `supervised`, so
a training sequence carries many retrieval targets instead of one; evals use 0.

Scores: exact match of the first output line, and MRCR's similarity, the difflib
`SequenceMatcher` ratio between the output and the answer (what OpenAI's MRCR grader
computes, without its random-prefix check, since our prompts carry none).
"""

from __future__ import annotations

import difflib
import random
from dataclasses import dataclass, field
from typing import Callable

from ..latency_specialized.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
LENGTHS = (1024, 4096, 16384, 65536)

_WORDS = ("amber", "bright", "cold", "deep", "early", "faint", "gold", "hollow", "iron", "jade",
          "keen", "lone", "mild", "north", "odd", "pale", "quiet", "red", "slow", "tall", "under",
          "vast", "warm", "young", "brook", "cliff", "dune", "ember", "fern", "grove", "hill",
          "isle", "lake", "moss", "night", "oak", "pine", "rain", "stone", "tide", "vale", "wind",
          "bells", "crows", "drums", "fires", "gates", "horns", "lamps", "ropes", "sails", "wheels")
_TOPICS = ("tapirs", "rivers", "clocks", "comets", "bees", "harbors", "lanterns", "glaciers",
           "owls", "bridges", "deserts", "violins", "orchards", "volcanoes", "ferries", "kites",
           "mines", "otters", "towers", "storms", "markets", "foxes", "canals", "meadows")
_KINDS = ("poem", "story", "note", "riddle")
_KEY_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789"


@dataclass(frozen=True)
class Sample:
    task: str
    length: int
    seed: int
    prompt: str  # the text after BOS
    answer: str
    prompt_ids: list[int] = field(repr=False)
    answer_ids: list[int] = field(repr=False)  # answer bytes + EOS
    supervised: tuple[tuple[int, int], ...] = field(default=(), repr=False)  # [start, end) in prompt_ids
    meta: dict = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class Score:
    exact: bool
    similarity: float


class _Builder:
    """Assembles the context text up to a byte budget, remembering supervised spans."""

    def __init__(self, budget: int):
        self.budget, self.parts, self.size, self.spans = budget, [], 0, []

    def fits(self, text: str) -> bool:
        return self.size + len(text) <= self.budget

    def add(self, text: str, answer: str = "", supervise: bool = False) -> None:
        start = self.size + len(text)
        self.parts.append(text + answer)
        self.size += len(text) + len(answer)
        if supervise and answer:
            self.spans.append((start, start + len(answer)))

    def finish(self, task: str, length: int, seed: int, query: str, answer: str,
               meta: dict) -> Sample:
        # a line of dots fills the few bytes no whole unit fitted into, so the length is exact
        gap = self.budget - self.size
        pad = "" if gap == 0 else "." * (gap - 1) + "\n"
        prompt = "".join(self.parts) + pad + query
        ids = TOK.encode(prompt)
        assert len(ids) == length, (task, len(ids), length)
        spans = tuple((a + 1, b + 1) for a, b in self.spans)  # +1: BOS comes first
        return Sample(task, length, seed, prompt, answer, ids, list(answer.encode()) + [TOK.EOS],
                      spans, meta)


def _rng(task: str, length: int, seed: int) -> random.Random:
    return random.Random(f"k3-evals:{task}:{length}:{seed}")


def _budget(task: str, length: int, query: str, smallest_unit: int) -> int:
    budget = length - 1 - len(query)
    if budget < smallest_unit:
        raise ValueError(f"{task}: a context of {length} tokens is too short; it needs at least "
                         f"{1 + len(query) + smallest_unit} tokens (BOS, one context unit and the query)")
    return budget


def _check(length: int, seed: int, practice: float) -> None:
    if not isinstance(length, int) or length < 1:
        raise ValueError(f"length must be a positive number of tokens, found {length!r}")
    if not isinstance(seed, int):
        raise ValueError(f"seed must be an integer, found {seed!r}")
    if not 0.0 <= practice < 1.0:
        raise ValueError(f"practice must be a fraction in [0, 1), found {practice!r}")


# ---------------------------------------------------------------------- MRCR


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def mrcr(length: int, seed: int, *, practice: float = 0.0) -> Sample:
    """Multi-round coreference: repeat the n-th answer to one of many recurring asks."""
    _check(length, seed, practice)
    rng = _rng("mrcr", length, seed)
    texts_by_ask: dict[tuple[str, str], list[str]] = {}
    rounds: list[tuple[tuple[str, str], int, str]] = []  # (ask, ordinal, text)
    # a pool of asks sized so each recurs about three times at any length
    n_asks = max(3, length // 240)
    pool = sorted({(rng.choice(_KINDS), rng.choice(_TOPICS)) for _ in range(n_asks)})
    longest_query = "User: repeat riddle 999th about volcanoes\nBot: "
    b = _Builder(_budget("mrcr", length, longest_query, 80))
    while True:
        if practice and rounds and rng.random() < practice:
            ask, n, text = rng.choice(rounds)
            line = f"User: repeat {ask[0]} {_ordinal(n)} about {ask[1]}\nBot: "
            if not b.fits(line + text + "\n"):
                break
            b.add(line, text + "\n", supervise=True)
            continue
        ask = rng.choice(pool)
        text = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(6, 11)))
        line = f"User: write a {ask[0]} about {ask[1]}\nBot: "
        if not b.fits(line + text + "\n"):
            break
        b.add(line, text + "\n", supervise=bool(practice))
        texts_by_ask.setdefault(ask, []).append(text)
        rounds.append((ask, len(texts_by_ask[ask]), text))
    if not rounds:
        raise ValueError(f"mrcr: a context of {length} tokens fits no dialogue round; use at least 200")
    index = rng.randrange(len(rounds))
    ask, n, text = rounds[index]
    query = f"User: repeat {ask[0]} {_ordinal(n)} about {ask[1]}\nBot: "
    b.budget -= len(query) - len(longest_query)  # the real query is shorter: give the pad its bytes
    meta = {"depth": index / len(rounds), "ordinal": n, "occurrences": len(texts_by_ask[ask]),
            "rounds": len(rounds)}
    return b.finish("mrcr", length, seed, query, text, meta)


# ---------------------------------------------------------------------- key-value retrieval


def kv(length: int, seed: int, *, needles: int = 2, depths: tuple[float, ...] | None = None,
       practice: float = 0.0) -> Sample:
    """Multi-needle key-value retrieval; needle i sits at depth depths[i] ∈ [0, 1] of the context."""
    _check(length, seed, practice)
    if not isinstance(needles, int) or needles < 1:
        raise ValueError(f"kv: needles must be a positive integer, found {needles!r}")
    if depths is not None and (len(depths) != needles or not all(0.0 <= d <= 1.0 for d in depths)):
        raise ValueError(f"kv: depths must give one fraction in [0, 1] per needle ({needles}), "
                         f"found {depths!r}")
    rng = _rng("kv", length, seed)
    line_size = len("abcdef=12345\n")
    query_size = len("get :") + needles * 7
    budget = _budget("kv", length, "x" * query_size, needles * line_size)
    seen: set[str] = set()

    def fresh_key() -> str:
        while True:
            k = "".join(rng.choice(_KEY_CHARS) for _ in range(6))
            if k not in seen:
                seen.add(k)
                return k

    # all lines are drawn before any is placed, so the needles' line numbers can be fixed first;
    # a practice query asks as many keys as the final one, so training sees the asked format
    fact_size, query_line_size = line_size, len("get :\n") + needles * 13 - 2
    lines: list[tuple[str, str, bool]] = []  # (keys, values, practice query?), space-separated
    facts: list[int] = []  # indices of the fact lines
    used = 0
    while True:
        if practice and len(facts) >= needles and rng.random() < practice:
            asked = [lines[i] for i in rng.sample(facts, needles)]
            size, line = query_line_size, (" ".join(a[0] for a in asked), " ".join(a[1] for a in asked), True)
        else:
            size, line = fact_size, (fresh_key(), f"{rng.randrange(100000):05d}", False)
        if used + size > budget:
            break
        if not line[2]:
            facts.append(len(lines))
        lines.append(line)
        used += size
    if len(facts) < needles:
        raise ValueError(f"kv: a context of {length} tokens holds {len(facts)} facts, fewer than "
                         f"{needles} needles; use a longer context or fewer needles")
    picks: list[int] = []
    for i in range(needles):
        depth = depths[i] if depths is not None else rng.random()
        want = min(int(depth * len(facts)), len(facts) - 1)
        # nearest unused fact line to the wanted depth
        order = sorted(range(len(facts)), key=lambda j: (abs(j - want), j))
        picks.append(next(facts[j] for j in order if facts[j] not in picks))
    b = _Builder(budget)
    for k, v, is_query in lines:
        if is_query:
            b.add(f"get {k}:", v + "\n", supervise=True)
        else:
            b.add(f"{k}=", v + "\n", supervise=False)
    query = "get " + " ".join(lines[i][0] for i in picks) + ":"
    answer = " ".join(lines[i][1] for i in picks)
    b.budget += query_size - len(query)
    meta = {"depths": [facts.index(i) / max(1, len(facts) - 1) for i in picks], "facts": len(facts)}
    return b.finish("kv", length, seed, query, answer, meta)


# ---------------------------------------------------------------------- arithmetic


def _lsd_first(n: int, width: int) -> str:
    return f"{n:0{width}d}"[::-1]


def _has_carry(a: int, b: int) -> bool:
    while a or b:
        if a % 10 + b % 10 >= 10:
            return True
        a, b = a // 10, b // 10
    return False


def arith(length: int, seed: int, *, digits: int = 8, practice: float = 0.0) -> Sample:
    """Exact addition of two `digits`-digit numbers with carries, after worked examples."""
    _check(length, seed, practice)
    if not isinstance(digits, int) or not 1 <= digits <= 40:
        raise ValueError(f"arith: digits must be an integer in 1..40, found {digits!r}")
    rng = _rng("arith", length, seed)

    def problem() -> tuple[str, str]:
        while True:
            a, b = rng.randrange(10 ** digits), rng.randrange(10 ** digits)
            if _has_carry(a, b):
                return (f"{_lsd_first(a, digits)}+{_lsd_first(b, digits)}=",
                        _lsd_first(a + b, digits + 1))

    query, answer = problem()
    b = _Builder(_budget("arith", length, query, 0))
    examples = 0
    while True:
        q, ans = problem()
        if not b.fits(q + ans + "\n"):
            break
        b.add(q, ans + "\n", supervise=bool(practice))
        examples += 1
    return b.finish("arith", length, seed, query, answer, {"digits": digits, "examples": examples})


# ---------------------------------------------------------------------- suites and scores

TASKS: dict[str, Callable[..., Sample]] = {"mrcr": mrcr, "kv": kv, "arith": arith}
PRIMARY = {"mrcr": "similarity", "kv": "exact", "arith": "exact"}


def make(task: str, length: int, seed: int, **kw) -> Sample:
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; the tasks are {', '.join(TASKS)}")
    return TASKS[task](length, seed, **kw)


def suite(task: str, length: int, n: int, seed: int = 0, **kw) -> list[Sample]:
    """n samples of one task at one length; sample i uses seed·1_000_003 + i."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"a suite needs n >= 1 samples, found {n!r}")
    return [make(task, length, seed * 1_000_003 + i, **kw) for i in range(n)]


def first_line(text: str) -> str:
    """The model's answer: its output up to the first newline, trailing spaces dropped."""
    return text.split("\n", 1)[0].rstrip()


def similarity(prediction: str, answer: str) -> float:
    """MRCR's score: difflib's SequenceMatcher ratio, 2·matches / (len(a) + len(b))."""
    return difflib.SequenceMatcher(None, prediction, answer).ratio()


def score(sample: Sample, output: str) -> Score:
    pred = first_line(output)
    return Score(exact=pred == sample.answer, similarity=similarity(pred, sample.answer))


def primary_value(sample: Sample, s: Score) -> float:
    """The task's headline number for one sample: similarity (MRCR) or exact match (0/1)."""
    return s.similarity if PRIMARY[sample.task] == "similarity" else float(s.exact)
