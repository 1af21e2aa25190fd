"""BFCL-v4's categories as the harness runs them, and what its summary makes of the official
score files: each category's accuracy, the entries whose generation failed, the official overall
and the overall over the offline categories, and the lines the command prints."""

from __future__ import annotations

import csv
import json
from pathlib import Path

MODEL_ID = "envace-jax-FC"  # no underscores: the evaluator maps '_' in directory names to '/'
DISPLAY_NAME = "envace_jax policy (FC Qwen3 format)"  # no commas: data_*.csv is unquoted

NON_LIVE = ["simple_python", "simple_java", "simple_javascript", "multiple", "parallel"]
NON_LIVE += ["parallel_multiple", "irrelevance"]
LIVE = ["live_simple", "live_multiple", "live_parallel", "live_parallel_multiple"]
LIVE += ["live_irrelevance", "live_relevance"]
MULTI_TURN = ["multi_turn_base", "multi_turn_miss_func", "multi_turn_miss_param"]
MULTI_TURN += ["multi_turn_long_context"]
MEMORY_OFFLINE = ["memory_kv", "memory_rec_sum"]
OFFLINE = NON_LIVE + LIVE + MULTI_TURN + MEMORY_OFFLINE
NOT_OFFLINE = {
    "web_search_base": "needs the internet (SerpAPI web search)",
    "web_search_no_snippet": "needs the internet (SerpAPI web search)",
    "memory_vector": "downloads a sentence-transformers embedding model from the Hugging Face hub",
}


def read_scores(root: Path) -> dict[str, dict]:
    """category -> the header line of its official score file (accuracy, counts)."""
    scores = {}
    for path in sorted((root / "score" / MODEL_ID).rglob("BFCL_v4_*_score.json")):
        cat = path.name[len("BFCL_v4_") : -len("_score.json")]
        with open(path) as f:
            head = json.loads(f.readline())
        scores[cat] = {
            "accuracy": head["accuracy"],
            "correct_count": head.get("correct_count"),
            "total_count": head["total_count"],
            "file": str(path.relative_to(root)),
        }
    return scores


def inference_errors(root: Path) -> dict[str, int]:
    """category -> entries whose generation failed (the package records the error as the
    result, and the checker scores it 0), e.g. a prompt longer than the model's context."""
    out = {}
    for path in sorted((root / "result" / MODEL_ID).rglob("BFCL_v4_*_result.json")):
        cat = path.name[len("BFCL_v4_") : -len("_result.json")]
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        bad = [
            r
            for r in rows
            if isinstance(r.get("result"), str) and r["result"].startswith("Error during inference")
        ]
        if bad:
            out[cat] = len(bad)
    return out


def _mean(xs):
    return sum(xs) / len(xs)


def offline_overall(scores: dict[str, dict]) -> float:
    """The official overall formula (eval_runner_helper: 10 non-live, 10 live, 10 irrelevance,
    30 multi-turn, 40 agentic) with agentic = memory over its offline backends only (web search
    and memory_vector left out rather than counted as 0). Categories not run count as 0, as in
    the official formula."""

    def acc(c):
        return scores[c]["accuracy"] if c in scores else 0.0

    def count(c):
        return scores[c]["total_count"] if c in scores else 0

    simple = _mean([acc("simple_python"), acc("simple_java"), acc("simple_javascript")])
    non_live = _mean([simple, acc("multiple"), acc("parallel"), acc("parallel_multiple")])
    live_cats = ["live_simple", "live_multiple", "live_parallel", "live_parallel_multiple"]
    n = sum(count(c) for c in live_cats)
    live = sum(acc(c) * count(c) for c in live_cats) / n if n else 0.0
    irrelevance = _mean([acc("irrelevance"), acc("live_irrelevance")])
    multi_turn = _mean([acc(c) for c in MULTI_TURN])
    memory = _mean([acc(c) for c in MEMORY_OFFLINE])
    parts = [non_live, live, irrelevance, multi_turn, memory]
    weights = [10, 10, 10, 30, 40]
    return sum(p * w for p, w in zip(parts, weights, strict=True)) / sum(weights)


def official_overall(root: Path) -> float | None:
    path = root / "score" / "data_overall.csv"
    if not path.exists():
        return None
    with open(path) as f:
        for row in csv.DictReader(f):
            if row.get("Model") == DISPLAY_NAME:
                value = row.get("Overall Acc", "")
                try:
                    return float(value.rstrip("%")) / (100 if value.endswith("%") else 1)
                except ValueError:
                    return None
    return None


def summarize(root: Path, categories: list[str], limit: int | None, label: str) -> dict:
    scores = read_scores(root)
    missing = [c for c in categories if c not in scores]
    summary = {
        "run": label,
        # Every offline category, whole: only then is a number over them an overall.
        "complete": limit is None and set(categories) == set(OFFLINE),
        "model_id": MODEL_ID,
        "limit_per_category": limit,
        "categories": scores,
        "categories_without_score_file": missing,
        "inference_errors": inference_errors(root),
        "not_run_needs_internet": NOT_OFFLINE,
        "overall_official_formula": official_overall(root),
        "overall_official_formula_note": (
            "data_overall.csv 'Overall Acc': every category not run (web search, memory_vector"
            + (", and any not selected" if set(categories) != set(OFFLINE) else "")
            + ") counts as 0"
        ),
        "overall_offline_categories": offline_overall(scores),
        "overall_offline_categories_note": (
            "official weights with web search and memory_vector left out (they need the "
            "internet); NOT comparable to leaderboard numbers"
            + ("; partial run (--limit)" if limit else "")
        ),
        "score_dir": str(root / "score"),
    }
    return summary


def summary_lines(summary: dict) -> list[str]:
    """What the command prints: each category's score, then an overall only for a complete
    run. A partial run's weighted number counts every category not run as 0, so it is shown as
    what it is and never called overall."""
    lines = [
        f"{cat:28s} {s['accuracy']:.4f}  ({s['correct_count']}/{s['total_count']})"
        for cat, s in summary["categories"].items()
    ]
    weighted = summary["overall_offline_categories"]
    if summary["complete"]:
        lines.append(
            f"overall (official formula, not-run = 0): {summary['overall_official_formula']}"
        )
        lines.append(f"overall (offline categories only)      : {weighted:.4f}")
    else:
        limit = summary["limit_per_category"]
        part = f"the first {limit} entries of each category" if limit else "some categories"
        lines.append(
            f"partial run ({part}): no overall; the official weights over it would give "
            f"{weighted:.4f}, with every category not run counted as 0"
        )
    lines.append("not run (need the internet): " + ", ".join(summary["not_run_needs_internet"]))
    return lines
