"""lm-eval hooks of the k3 task configs: datasets and scores (loaded by lm-eval by file path).

The synthetic tasks read the JSONL that `python -m vllm.models.kimi_k3.nvidia.evals.lm_eval_data`
writes (to `$K3_EVAL_DATA`, else the `data/` folder beside this file); the real MRCR config
renders openai/mrcr's chat messages as a transcript and grades like OpenAI's MRCR: 0 unless
the reply starts with the random prefix, else the difflib ratio of the rest to the answer;
AIME25 takes the last \\boxed{} integer (else the last integer) and matches it exactly.
lm-eval imports this file outside any package, so the imports are absolute.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from vllm.models.kimi_k3.nvidia.evals.tasks import first_line, similarity


def _data_dir() -> Path:
    return Path(os.environ.get("K3_EVAL_DATA", Path(__file__).resolve().parent / "data"))


def _load(task: str, **_metadata) -> dict:
    import datasets

    path = _data_dir() / f"k3_{task}_synthetic.jsonl"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: write the synthetic data first with "
            f"python -m vllm.models.kimi_k3.nvidia.evals.lm_eval_data --out {path.parent}")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {"test": datasets.Dataset.from_list(rows, split=datasets.Split.TEST)}


def mrcr_dataset(**metadata) -> dict:
    return _load("mrcr", **metadata)


def kv_dataset(**metadata) -> dict:
    return _load("kv", **metadata)


def arith_dataset(**metadata) -> dict:
    return _load("arith", **metadata)


def process_synthetic(doc: dict, results: list[str]) -> dict:
    pred = first_line(results[0])
    return {"exact_match": float(pred == doc["answer"]), "similarity": similarity(pred, doc["answer"])}


def mrcr_doc_to_text(doc: dict) -> str:
    messages = json.loads(doc["prompt"]) if isinstance(doc["prompt"], str) else doc["prompt"]
    turns = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
    return "\n\n".join(turns) + "\n\nAssistant:"


def mrcr_process_results(doc: dict, results: list[str]) -> dict:
    prefix, reply, answer = doc["random_string_to_prepend"], results[0].strip(), doc["answer"]
    if not reply.startswith(prefix):
        return {"mrcr_score": 0.0}
    return {"mrcr_score": similarity(reply.removeprefix(prefix), answer.removeprefix(prefix))}


def mrcr_process_docs(dataset):
    limit = int(os.environ.get("K3_MRCR_MAX_CHARS", "2000000"))
    return dataset.filter(lambda doc: doc["n_chars"] <= limit)


def _final_integer(text: str) -> int | None:
    boxed = re.findall(r"\\boxed\{\s*(-?[0-9][0-9,]*)\s*\}", text)
    found = boxed or re.findall(r"-?[0-9][0-9,]*", text)
    return int(found[-1].replace(",", "")) if found else None


def aime_process_results(doc: dict, results: list[str]) -> dict:
    got = _final_integer(results[0])
    return {"exact_match": float(got is not None and got == int(str(doc["answer"]).strip()))}
