"""Build, on CPU, everything the GPU training run needs, into a staging folder (default ``.stage``).

``python -m eagle3_train.build_data --out .stage [--only eval,tiny-kimi,smollm2,gguf]``

Why a separate step: the GPU machine has no network and each call carries at most 64 MiB, so
all parsing, tokenizer training and tokenization happen here, once, into compact files:

  eval_prompts.jsonl      held-out ShareGPT first-turn prompts + GSM8K *test* questions (chats)
  regen_prompts.jsonl     training prompts (GSM8K train questions, ShareGPT train first turns),
                          shuffled: what ``regenerate`` asks the targets to answer
  tiny-kimi/              tokenizer/ (the BPE trained here) and shard sets ``sharegpt`` (train
                          split), ``gsm8k`` (train) and ``heldout`` (held-out ShareGPT), uint16
  smollm2/                SmolLM2-tokenized shard sets ``sharegpt`` (a budgeted subset) and ``gsm8k``
  gguf-a/, gguf-b/        the SmolLM2 GGUF cut in two parts that fit beside other carried files
                          (each folder: one part, the manifest with sha256s, and ``pylib/`` with
                          the pure-Python ``gguf`` reader that the GPU image lacks); the GPU side
                          (``smollm2.convert_from_parts``) rebuilds the HF folder from them and
                          checks it is bit-identical to the one converted here

Nothing held out (ShareGPT held-out conversations, GSM8K test) enters a training set or the
regeneration prompts.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import shutil
import time
from pathlib import Path

from atom_like.zoo import data
from eagle3_train.shards import encode_chat, write_shards

PARTS = ("eval", "tiny-kimi", "smollm2", "gguf")


def write_jsonl(path: Path, records) -> int:
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
            n += 1
    return n


def build_prompts(out: Path, sharegpt_train, eval_per_set: int) -> dict:
    """eval_prompts.jsonl (held-out only) and regen_prompts.jsonl (training prompts only)."""
    n_eval = write_jsonl(out / "eval_prompts.jsonl", [
        *({"set": "sharegpt", "messages": c} for c in data.sharegpt_eval_prompts(eval_per_set)),
        *({"set": "gsm8k", "messages": c} for c in data.gsm8k_eval_prompts(eval_per_set))])
    regen, seen = [], set()
    for conv_id, chat in sharegpt_train:
        group = data.conversation_group(conv_id)
        prompt = data.first_turn_prompt(chat)
        if group not in seen and 16 <= len(prompt[-1]["content"]) <= 2000:
            seen.add(group)
            regen.append(prompt)
    regen += [c[:1] for c in data.gsm8k_train_chats()]
    random.Random(0).shuffle(regen)
    n_regen = write_jsonl(out / "regen_prompts.jsonl", ({"messages": c} for c in regen))
    return {"eval_prompts": n_eval, "regen_prompts": n_regen}


def build_tiny_kimi(out: Path, sharegpt_train, vocab: int, tokenizer_chars: int) -> dict:
    from atom_like.zoo.kimi_tokenizer import train_tokenizer

    folder = out / "tiny-kimi"
    shutil.rmtree(folder, ignore_errors=True)
    gsm8k = data.gsm8k_train_chats()
    chats = [c for _, c in sharegpt_train]

    def texts():
        budget = tokenizer_chars
        for chat in gsm8k + chats:
            for m in chat:
                yield m["content"]
                budget -= len(m["content"])
            if budget <= 0:
                return

    t = time.time()
    tok = train_tokenizer(texts(), vocab, folder / "tokenizer")
    info = {"tokenizer_seconds": round(time.time() - t, 1), "vocab": len(tok)}
    heldout = [c for _, c in data.load_sharegpt("heldout")]
    for name, items in (("sharegpt", chats), ("gsm8k", gsm8k), ("heldout", heldout)):
        info[name] = write_shards((encode_chat(tok, c) for c in items), folder, name, tok)
    return info


def build_smollm2(out: Path, sharegpt_train, sharegpt_tokens: int) -> dict:
    from transformers import AutoTokenizer

    from atom_like.zoo.registry import resolve

    tok = AutoTokenizer.from_pretrained(str(resolve("smollm2-135m")))
    folder = out / "smollm2"
    shutil.rmtree(folder, ignore_errors=True)
    chats = [c for _, c in sharegpt_train]
    random.Random(1).shuffle(chats)

    def budgeted():
        left = sharegpt_tokens
        for chat in chats:
            doc = encode_chat(tok, chat)
            yield doc
            left -= len(doc[0])
            if left <= 0:
                return

    return {"sharegpt": write_shards(budgeted(), folder, "sharegpt", tok),
            "gsm8k": write_shards((encode_chat(tok, c) for c in data.gsm8k_train_chats()), folder, "gsm8k", tok)}


def build_gguf(out: Path, part_mb: float) -> dict:
    """The GGUF cut in two: ``gguf-a`` (the first ``part_mb`` MB) and ``gguf-b`` (the rest), each
    with the manifest (sha256s, and the tensor digest of the HF folder converted here, which the
    GPU-side conversion must reproduce) and the ``gguf`` reader with its dist-info."""
    from importlib.metadata import version

    import gguf as gguf_lib

    from atom_like.zoo.registry import resolve
    from atom_like.zoo.smollm2 import GGUF_NAME, gguf_path

    blob = gguf_path().read_bytes()
    cut = int(part_mb * 1e6)
    chunks = [blob[:cut], blob[cut:]]
    parts = [{"file": f"{GGUF_NAME}.part{i}", "bytes": len(c), "sha256": hashlib.sha256(c).hexdigest()}
             for i, c in enumerate(chunks)]
    manifest = {"gguf": GGUF_NAME, "sha256": hashlib.sha256(blob).hexdigest(), "parts": parts,
                "tensor_sha256": json.loads((resolve("smollm2-135m") / "zoo.json").read_text())["tensor_sha256"],
                "gguf_version": version("gguf")}
    site = Path(gguf_lib.__file__).parent.parent  # the package and its dist-info (transformers checks the version)
    for letter, part, chunk in zip("ab", parts, chunks):
        folder = out / f"gguf-{letter}"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        (folder / part["file"]).write_bytes(chunk)
        (folder / "manifest.json").write_text(json.dumps(manifest, indent=2))
        for src in [site / "gguf", *site.glob(f"gguf-{version('gguf')}.dist-info")]:
            shutil.copytree(src, folder / "pylib" / src.name, ignore=shutil.ignore_patterns("__pycache__"))
    return manifest


def folder_mb(path: Path) -> float:
    return round(sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file()) / 1e6, 2)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m eagle3_train.build_data", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".stage")
    ap.add_argument("--only", default=",".join(PARTS), help=f"comma-separated subset of {PARTS}")
    ap.add_argument("--vocab", type=int, default=8192, help="tiny-kimi BPE vocabulary size")
    ap.add_argument("--tokenizer-chars", type=int, default=40_000_000, help="text the BPE is trained on")
    ap.add_argument("--smollm2-sharegpt-tokens", type=int, default=10_000_000)
    ap.add_argument("--eval-per-set", type=int, default=256)
    ap.add_argument("--gguf-part-mb", type=float, default=60.0, help="size of GGUF part 0 (part 1 is the rest)")
    args = ap.parse_args(argv)
    parts = args.only.split(",")
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise SystemExit(f"unknown parts {unknown}; choose from {PARTS}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    report_path = out / "build_report.json"
    report = json.loads(report_path.read_text()) if report_path.is_file() else {}
    sharegpt_train = data.load_sharegpt("train") if {"eval", "tiny-kimi", "smollm2"} & set(parts) else None
    if "eval" in parts:
        report["prompts"] = build_prompts(out, sharegpt_train, args.eval_per_set)
    if "tiny-kimi" in parts:
        report["tiny-kimi"] = build_tiny_kimi(out, sharegpt_train, args.vocab, args.tokenizer_chars)
    if "smollm2" in parts:
        report["smollm2"] = build_smollm2(out, sharegpt_train, args.smollm2_sharegpt_tokens)
    if "gguf" in parts:
        report["gguf"] = build_gguf(out, args.gguf_part_mb)
    report["sizes_mb"] = {p.name: folder_mb(p) if p.is_dir() else round(p.stat().st_size / 1e6, 2)
                          for p in sorted(out.iterdir()) if p.name != "build_report.json"}
    report["seconds"] = round(time.time() - t0, 1)
    report_path.write_text(json.dumps(report, indent=2))
    print(json.dumps(report["sizes_mb"], indent=2))
    print(f"built {parts} into {out} in {report['seconds']}s")


if __name__ == "__main__":
    main()
