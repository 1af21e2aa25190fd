"""Check task files before a job reads them.

    python -m envace_jax.data.validate tasks/train.parquet more/ 'extra_*.jsonl'
    python -m envace_jax.data.validate --max-prompt-tokens 3500 --tokenizer CKPT train.parquet

Each argument is a file, a directory of task files, a glob, or a comma-separated list of them
(what `config.data.train_files` takes). Prints one line per bad record (file, record index,
task id, every defect), one per record a filter drops (`dropped (invalid_tools): ...`; the
job drops these too, as the reference does), then a summary line. Duplicate task ids are
checked across all the files.

Exit status: 0 when every record is valid (records a filter drops do not count as invalid),
1 when any record or file is invalid, 2 on a usage error (a file that does not exist, an
entry that names no task file, bad options).
"""

from __future__ import annotations

import argparse
import sys

from envace_jax.data.checklists import DEFAULT_WEIGHT_TOLERANCE
from envace_jax.data.readers import TaskFileError
from envace_jax.data.sources import Scanner, resolve_files


def _prompt_length(tokenizer_dir: str):
    from envace_jax.text.role_pieces import prompt_ids
    from envace_jax.text.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir)
    return lambda task: len(prompt_ids(tokenizer, task.messages, task.template_tools))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m envace_jax.data.validate", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("files", nargs="+", help="task files, directories or globs")
    parser.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=0,
        help="also count tasks whose opening prompt, tools rendered, is longer (needs "
        "--tokenizer; 0 = no such filter)",
    )
    parser.add_argument("--tokenizer", help="tokenizer directory or name that counts prompts")
    parser.add_argument(
        "--weight-tolerance",
        type=float,
        default=DEFAULT_WEIGHT_TOLERANCE,
        help="how far a turn's item weights may sum from 1",
    )
    args = parser.parse_args(argv)
    if args.max_prompt_tokens < 0:
        parser.error("--max-prompt-tokens must be >= 0")
    if args.max_prompt_tokens and not args.tokenizer:
        parser.error("--max-prompt-tokens needs --tokenizer")
    try:
        files = resolve_files([p for arg in args.files for p in arg.split(",")], "validate")
    except TaskFileError as e:
        print(e, file=sys.stderr)
        return 2
    prompt_length = None
    if args.max_prompt_tokens:
        try:
            prompt_length = _prompt_length(args.tokenizer)
        except Exception as e:  # a tokenizer that does not load is a usage error
            message = f"validate: --tokenizer {args.tokenizer}: {type(e).__name__}: {e}"
            print(message, file=sys.stderr)
            return 2
    scanner = Scanner(
        "validate",
        files,
        prompt_length=prompt_length,
        max_prompt_tokens=args.max_prompt_tokens,
        weight_tolerance=args.weight_tolerance,
        keep_tasks=False,
    )
    report = scanner.report
    bad_files = 0
    for fi in range(len(files)):
        shown = len(report.rejected), len(report.filtered)
        try:
            scanner.scan_file(fi)
        except TaskFileError as e:
            bad_files += 1
            print(e)
        for r in report.rejected[shown[0] :]:
            print(r.line())
        for r in report.filtered[shown[1] :]:
            name, _, why = r.reason.partition(": ")
            print(r._replace(reason=f"dropped ({name}): {why}").line())
        sys.stdout.flush()
    summary = report.summary()
    if bad_files:
        summary += f"; {bad_files} unreadable file" + ("s" if bad_files > 1 else "")
    print(summary)
    return 1 if report.rejected or bad_files else 0


if __name__ == "__main__":
    sys.exit(main())
