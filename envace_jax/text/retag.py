"""Make a ChatML checkpoint speak the Qwen3 tool-use layout: tool tags on spare special ids.

This project's trajectories need single-id `<tool_call>`, `</tool_call>`, `<tool_response>`,
`</tool_response>`, `<think>` and `</think>` next to ChatML's `<|im_start|>`, `<|im_end|>` and
`<|endoftext|>` (see `tokenizer.special_ids`), and a chat template that renders tool calls and
responses the way Qwen3's does. Many small ChatML models (SmolLM2, for one) have the three ChatML
tokens and a handful of special tokens they rarely use (SmolLM2's `<repo_name>`, `<file_sep>`,
`<jupyter_code>`, ...), but no tool tags. Renaming spare special tokens keeps the vocabulary,
and so the embedding matrix, unchanged: the renamed rows start from whatever the model learned
for the old token, and the warm start teaches them their new role.

    python -m envace_jax.text.retag SRC_DIR OUT_DIR

SRC_DIR is an HF checkpoint directory (e.g. from `envace_jax.models.gguf_convert`); OUT_DIR
gets the same weights (hard-linked where possible), the retagged `tokenizer.json`, the demo
tokenizer's chat template, and `<|endoftext|>` as pad token.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

from envace_jax.text.tokenizer import DEMO_TOKENIZER_DIR, SPECIAL_TOKEN_TEXTS

CHATML = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: not found (need an HF tokenizer directory)") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: line {e.lineno}: not valid JSON ({e.msg})") from None


def retag_plan(tokenizer_json: dict, reserved: set[str]) -> dict[int, str]:
    """{spare special id: tag text} for the tags `tokenizer_json` lacks.

    Spare ids are added special tokens other than ChatML's and `reserved` (the tokenizer's
    bos/eos/unk/pad texts), taken in id order. Raises ValueError naming what is missing."""
    added = tokenizer_json.get("added_tokens") or []
    by_text = {a["content"]: a for a in added}
    absent = [t for t in CHATML if t not in by_text]
    if absent:
        raise ValueError(f"tokenizer.json: added_tokens lack the ChatML tokens {absent}")
    needed = [t for t in SPECIAL_TOKEN_TEXTS.values() if t not in by_text]
    spare = [
        a["id"]
        for a in sorted(added, key=lambda a: a["id"])
        if a.get("special") and a["content"] not in CHATML and a["content"] not in reserved
    ]
    if len(spare) < len(needed):
        raise ValueError(
            f"tokenizer.json: {len(needed)} tags to place ({needed}) but only {len(spare)} spare "
            "special tokens to rename"
        )
    return dict(zip(spare, needed, strict=False))


def retag_tokenizer_json(tokenizer_json: dict, plan: dict[int, str]) -> dict:
    """A copy of `tokenizer_json` with each planned id's added token and vocab entry renamed."""
    out = json.loads(json.dumps(tokenizer_json))
    vocab = out["model"]["vocab"]
    for a in out["added_tokens"]:
        if a["id"] in plan:
            old = a["content"]
            if vocab.get(old) != a["id"]:
                raise ValueError(f"tokenizer.json: added token {old!r} is not vocab id {a['id']}")
            del vocab[old]
            a["content"] = plan[a["id"]]
            vocab[a["content"]] = a["id"]
    return out


def retag_checkpoint(src: str | os.PathLike, out: str | os.PathLike) -> dict[int, str]:
    """Writes `src`'s checkpoint to `out` with tool tags on spare special ids (module docstring).
    Returns {id: tag} for the renamed ids."""
    src, out = Path(src), Path(out)
    if src.resolve() == out.resolve():
        raise ValueError(f"retag: output directory {out} is the source; choose another")
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"{src / 'config.json'}: not found (need an HF checkpoint)")
    tok = _read_json(src / "tokenizer.json")
    tok_cfg = _read_json(src / "tokenizer_config.json")
    reserved = {tok_cfg.get(k) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
    plan = retag_plan(tok, {r for r in reserved if isinstance(r, str)})
    ids = {a["content"]: a["id"] for a in tok["added_tokens"]}

    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():  # weights and model config: hard links, no second copy on disk
        if f.is_file() and f.name not in TOKENIZER_FILES and f.name != "config.json":
            target = out / f.name
            target.unlink(missing_ok=True)
            try:
                os.link(f, target)
            except OSError:
                shutil.copy2(f, target)
    (out / "tokenizer.json").write_text(json.dumps(retag_tokenizer_json(tok, plan), indent=1))
    tok_cfg = {k: v for k, v in tok_cfg.items() if k != "chat_template"}
    tok_cfg["pad_token"] = "<|endoftext|>"  # eos (<|im_end|>) must stay a real token
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    shutil.copy2(DEMO_TOKENIZER_DIR / "chat_template.jinja", out / "chat_template.jinja")
    model_cfg = _read_json(src / "config.json")
    model_cfg["pad_token_id"] = ids["<|endoftext|>"]
    model_cfg["eos_token_id"] = ids["<|im_end|>"]
    (out / "config.json").write_text(json.dumps(model_cfg, indent=2))
    return plan


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src_dir")
    parser.add_argument("out_dir")
    args = parser.parse_args(argv)
    plan = retag_checkpoint(args.src_dir, args.out_dir)
    for i, tag in plan.items():
        print(f"id {i}: {tag}")
    print(args.out_dir)


if __name__ == "__main__":
    main()
