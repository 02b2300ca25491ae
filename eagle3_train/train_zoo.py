"""The GPU training run of the whole zoo, in stages, inside one command's time limit.

``ci/train_zoo.sh`` runs this on the device machine; atom_like/zoo/README.md gives the staging
plan (what to build here, what each call carries). Stages, chosen with ``ZOO_STAGES``:

  tiny-target   train tiny-kimi (train_target)                         ZOO_TARGET_MIN
  tiny-regen    tiny-kimi answers training prompts (regenerate)        ZOO_TINY_REGEN_MIN
  tiny-drafts   tiny-kimi-eagle3, -eagle3-mla, -eagle3.1-mla           ZOO_TINY_DRAFT_MIN (each)
  smol-convert  rebuild SmolLM2 from the carried GGUF parts (checked bit-identical)
  smol-regen    SmolLM2 answers training prompts                       ZOO_SMOL_REGEN_MIN
  smol-draft    smollm2-135m-eagle3 (draft vocab < vocab: d2t)         ZOO_SMOL_DRAFT_MIN
  smol-draft-more  its second phase: continued at lr 5e-4, replies x2   ZOO_SMOL_MORE_MIN

Why one process with a deadline: a device command may run 10 minutes and the machine may be
given back between calls, so every stage gets its minutes trimmed to what is left before
``ZOO_DEADLINE_MIN`` (default 9.3) minus that stage's fixed costs, and the results are packed into
``$OUT`` before the deadline: one report and a tar.gz split into 15 MiB parts (the device returns
at most 8 files of 16 MiB). The three tiny-kimi drafts train as parallel processes by default
(``ZOO_PARALLEL=1``): each is small and launch-bound, so sharing the GPU costs them little.
Work lives in ``ZOO_WORK`` (default /tmp/zoo_work), which a later call finds while the machine
stays warm; a stage whose input was made by an earlier call also looks in ``.stage/trained/``
(that call's output, unpacked and carried).
"""

from __future__ import annotations

import gc
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

STAGES = ["tiny-target", "tiny-regen", "tiny-drafts", "smol-convert", "smol-regen", "smol-draft", "smol-draft-more"]
# Sizes chosen so that tiny-kimi + its three drafts fit in 40 MB of bf16 (README).
TINY_DRAFTS = {
    "tiny-kimi-eagle3": ["--arch", "llama", "--heads", "4", "--kv-heads", "4", "--head-dim", "64",
                         "--intermediate-size", "512"],
    "tiny-kimi-eagle3-mla": ["--arch", "mla", "--intermediate-size", "512", "--draft-vocab", "4096"],
    "tiny-kimi-eagle3.1-mla": ["--arch", "mla", "--fc-norm", "--norm-output", "--intermediate-size", "512",
                               "--draft-vocab", "4096"],
}
TINY_DRAFT_TRAIN = ["--seq-len", "1024", "--batch-size", "16", "--lr", "2e-3"]
SMOL_DRAFT = ["--arch", "llama", "--draft-vocab", os.environ.get("ZOO_SMOL_DRAFT_VOCAB", "24576"),
              "--seq-len", "1024", "--batch-size", "16", "--lr", "1e-3"]


def env(name: str, default: str) -> str:
    return os.environ.get(name, default)


def planned_seconds(stage: str) -> float:
    """A stage's wall time: its budget in minutes plus its fixed costs (loading, evaluation, export)."""
    parallel = env("ZOO_PARALLEL", "1") == "1"
    return {
        "tiny-target": 60 * float(env("ZOO_TARGET_MIN", "5")) + 75,
        "tiny-regen": 60 * float(env("ZOO_TINY_REGEN_MIN", "0.5")) + 20,
        "tiny-drafts": (1 if parallel else len(TINY_DRAFTS)) * (60 * float(env("ZOO_TINY_DRAFT_MIN", "2")) + 75) + 30,
        "smol-convert": 60,
        "smol-regen": 60 * float(env("ZOO_SMOL_REGEN_MIN", "1")) + 30,
        "smol-draft": 60 * float(env("ZOO_SMOL_DRAFT_MIN", "5")) + 100,
        "smol-draft-more": 60 * float(env("ZOO_SMOL_MORE_MIN", "7")) + 100,
    }[stage]


class Run:
    def __init__(self):
        self.t0 = time.time()
        self.deadline = self.t0 + 60 * float(env("ZOO_DEADLINE_MIN", "9.3"))
        self.stage = Path(env("ZOO_STAGE", ".stage")).resolve()
        self.work = Path(env("ZOO_WORK", "/tmp/zoo_work"))
        self.out = Path(env("OUT", "zoo-out"))
        import torch

        self.device = env("ZOO_DEVICE", "cuda" if torch.cuda.is_available() else "cpu")
        self.produced: list[Path] = []
        self.report: dict = {"stages": {}}
        for sub in ("models", "logs", "data"):
            (self.work / sub).mkdir(parents=True, exist_ok=True)

    def minutes(self, stage: str, want: float) -> float:
        """``want`` minutes, or less: what is left before the deadline once this stage's fixed costs
        and the planned time of the stages after it are set aside."""
        plan = self.report["plan"]
        later = sum(planned_seconds(s) for s in plan[plan.index(stage) + 1:])
        fixed = planned_seconds(stage) - 60 * want
        return max(0.0, min(want, (self.deadline - time.time() - fixed - later) / 60))

    def find(self, name: str) -> Path:
        """An input made by this call, by an earlier call on this (warm) machine, or carried in
        ``.stage/trained`` (gathered into the work folder at start)."""
        for sub in ("models", "data"):
            if (self.work / sub / name).exists():
                return self.work / sub / name
        raise FileNotFoundError(f"{name} was not made by an earlier stage: run its stage first, or unpack that "
                                f"call's output into .stage/trained and carry it (atom_like/zoo/README.md)")

    def log(self, msg: str):
        print(f"[train_zoo {time.time() - self.t0:6.0f}s] {msg}", flush=True)


def free_gpu():
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def stage_tiny_target(run: Run):
    from eagle3_train import train_target

    minutes = run.minutes("tiny-target", float(env("ZOO_TARGET_MIN", "5")))
    out, logs = run.work / "models" / "tiny-kimi", run.work / "logs" / "tiny-kimi"
    summary = train_target.train(train_target.parse_args([
        "--data", str(run.stage / "tiny-kimi"), "--out", str(out), "--log-dir", str(logs),
        "--minutes", f"{minutes:.2f}", "--eval-prompts", str(run.stage / "eval_prompts.jsonl"),
        "--device", run.device, *shlex.split(env("ZOO_TARGET_ARGS", ""))]))
    run.produced += [out, logs]
    return {k: summary[k] for k in ("heldout_ppl", "heldout_assistant_ppl", "steps", "epochs", "train_seconds", "checks")}


def regen_stage(run: Run, target_dir: Path, name: str, minutes: float, batch: int, max_new: int):
    """The target's greedy replies to training prompts: on a GPU through our engine (several times
    transformers' batched ``generate``; ZOO_REGEN_ENGINE=0 picks that instead)."""
    from atom_like.zoo.data import read_jsonl
    from eagle3_train.regenerate import load_for_regeneration, regenerate
    from eagle3_train.shards import write_shards

    t = time.time()
    use_engine = run.device.startswith("cuda") and env("ZOO_REGEN_ENGINE", "1") == "1"
    target, tok, stop = load_for_regeneration(target_dir, use_engine, run.device)
    chats = [r["messages"] for r in read_jsonl(run.stage / "regen_prompts.jsonl")]
    batch, max_new = int(env("ZOO_REGEN_BATCH", str(batch))), int(env("ZOO_REGEN_MAX_NEW", str(max_new)))
    docs = regenerate(target, tok, chats, stop, max_new, batch, 512, time.time() + 60 * minutes)
    folder = run.work / "data" / name
    info = write_shards(docs, folder, "regen", tok, extra={"target": str(target_dir), "max_new_tokens": max_new,
                                                         "generator": "atom_like engine" if use_engine else "transformers"})
    run.produced.append(folder)
    del target
    free_gpu()
    return {"replies": len(docs), "reply_tokens": int(sum(sum(m) for _, m in docs)), "seconds": round(time.time() - t, 1),
            "generator": "engine" if use_engine else "transformers", "shard_bytes": sum(s["bytes"] for s in info["shards"])}


def stage_tiny_regen(run: Run):
    minutes = run.minutes("tiny-regen", float(env("ZOO_TINY_REGEN_MIN", "0.5")))
    return regen_stage(run, run.find("tiny-kimi"), "tiny-regen", minutes, 512, 256)


def draft_command(run: Run, name: str, target: Path, data: list[str], extra: list[str], minutes: float) -> list[str]:
    cmd = [sys.executable, "-m", "eagle3_train.train_eagle3", "--target", str(target), "--name", name,
           "--out", str(run.work / "models" / name), "--log-dir", str(run.work / "logs" / name),
           "--minutes", f"{minutes:.2f}", "--eval-prompts", str(run.stage / "eval_prompts.jsonl"),
           "--eval-per-set", env("ZOO_EVAL_PER_SET", "64")]
    for d in data:
        cmd += ["--data", d]
    return cmd + extra + ["--device", run.device, *shlex.split(env("ZOO_DRAFT_ARGS", ""))]


def run_drafts(run: Run, jobs: dict[str, list[str]], parallel: bool) -> dict:
    """Run draft trainings as subprocesses (logs to files), all at once or one after another;
    each result is its summary.json. A run still going at the deadline is stopped: its checkpoint
    was saved before its evaluation, so it still ships."""
    def start(name, cmd):
        log_file = run.work / "logs" / f"{name}.stdout"
        run.log(f"start {name}: {' '.join(cmd[1:])}")
        return subprocess.Popen(cmd, stdout=open(log_file, "w"), stderr=subprocess.STDOUT), log_file

    def finish(name, proc, log_file):
        try:
            rc = proc.wait(timeout=max(5.0, run.deadline - time.time()))
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
            run.log(f"{name} ran past the deadline and was stopped")
        tail = "\n".join(log_file.read_text().splitlines()[-22:])
        print(f"----- {name} (exit {rc}), last lines of {log_file.name}:\n{tail}", flush=True)
        run.produced += [run.work / "models" / name, run.work / "logs" / name, log_file]
        summary = run.work / "logs" / name / "summary.json"
        return json.loads(summary.read_text()) if rc == 0 and summary.is_file() else {"error": f"exit {rc}"}

    if parallel:
        started = {name: start(name, cmd) for name, cmd in jobs.items()}
        return {name: finish(name, *pl) for name, pl in started.items()}
    return {name: finish(name, *start(name, cmd)) for name, cmd in jobs.items()}


def stage_tiny_drafts(run: Run):
    parallel = env("ZOO_PARALLEL", "1") == "1"
    want = float(env("ZOO_TINY_DRAFT_MIN", "2"))
    minutes = run.minutes("tiny-drafts", want if parallel else want * len(TINY_DRAFTS)) / (1 if parallel else len(TINY_DRAFTS))
    target = run.find("tiny-kimi")
    data = [f"{run.stage / 'tiny-kimi'}:sharegpt,gsm8k*3"]
    try:
        data.append(f"{run.find('tiny-regen')}:regen*2")
    except FileNotFoundError:
        run.log("no tiny-kimi regenerated data: drafts train on the corpus only")
    jobs = {name: draft_command(run, name, target, data, extra + TINY_DRAFT_TRAIN, minutes)
            for name, extra in TINY_DRAFTS.items()}
    return run_drafts(run, jobs, parallel)


def stage_smol_convert(run: Run):
    from atom_like.zoo.smollm2 import convert_from_parts

    parts = run.work / "gguf"
    if not (parts / "manifest.json").is_file():
        raise FileNotFoundError("no SmolLM2 GGUF parts staged: carry .stage/gguf-a and .stage/gguf-b (README)")
    info = convert_from_parts(parts, run.work / "models" / "smollm2-135m")
    if not info["identical_to_staged_conversion"]:
        run.log("WARNING: the SmolLM2 conversion here differs from the one made where the data was built")
    return info


def stage_smol_regen(run: Run):
    minutes = run.minutes("smol-regen", float(env("ZOO_SMOL_REGEN_MIN", "1")))
    return regen_stage(run, run.find("smollm2-135m"), "smol-regen", minutes, 384, 256)


def smol_draft(run: Run, minutes: float, regen_repeat: int, extra: list[str]) -> dict:
    data = [f"{run.stage / 'smollm2'}:sharegpt,gsm8k*2"]
    try:
        data.append(f"{run.find('smol-regen')}:regen*{regen_repeat}")
    except FileNotFoundError:
        run.log("no SmolLM2 regenerated data: the draft trains on the corpus only")
    cmd = draft_command(run, "smollm2-135m-eagle3", run.find("smollm2-135m"), data, SMOL_DRAFT + extra, minutes)
    return run_drafts(run, {"smollm2-135m-eagle3": cmd}, parallel=False)


def stage_smol_draft(run: Run):
    minutes = run.minutes("smol-draft", float(env("ZOO_SMOL_DRAFT_MIN", "5")))
    return smol_draft(run, minutes, 2, ["--init", env("ZOO_SMOL_INIT", "")] if env("ZOO_SMOL_INIT", "") else [])


def stage_smol_draft_more(run: Run):
    """Phase 2 (the shipped recipe): continue smol-draft's checkpoint at half its learning rate,
    with the target's own replies weighted twice as much (they are what held-out prompts get)."""
    minutes = run.minutes("smol-draft-more", float(env("ZOO_SMOL_MORE_MIN", "7")))
    return smol_draft(run, minutes, 4, ["--init", str(run.find("smollm2-135m-eagle3")), "--lr", "5e-4"])


def gather_carried(run: Run):
    """Copy what this call carried into the work folder, where later stages and later calls (while
    the machine stays warm) find it: GGUF parts from ``.stage/gguf-*`` and earlier calls' outputs
    unpacked into ``.stage/trained/{models,data}``. Files already there are kept."""
    pairs = [(f, run.work / "gguf" / f.name) for d in sorted(run.stage.glob("gguf-*")) for f in d.iterdir()]
    pairs += [(f, run.work / sub / f.name) for sub in ("models", "data") if (run.stage / "trained" / sub).is_dir()
              for f in (run.stage / "trained" / sub).iterdir()]
    for src, dest in pairs:
        if dest.exists():
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(src, dest) if src.is_dir() else shutil.copy(src, dest)
        run.log(f"carried in: {dest}")


def table(report: dict) -> str:
    lines = [f"zoo training report ({report['device']}), stages {report['plan']}, {report['seconds']:.0f}s"]
    for stage, res in report["stages"].items():
        if not isinstance(res, dict):
            continue
        if stage == "tiny-target" and "heldout_ppl" in res:
            lines.append(f"tiny-kimi: held-out ppl {res['heldout_ppl']} (assistant tokens {res['heldout_assistant_ppl']}), "
                         f"{res['steps']} steps, {res['epochs']} epochs, {res['train_seconds']}s, checks ok={res['checks']['ok']}")
        elif stage in ("tiny-drafts", "smol-draft", "smol-draft-more"):
            for name, s in res.items():
                if "acceptance" not in s:
                    lines.append(f"{name}: {s.get('error', 'no acceptance measured')}")
                    continue
                for set_name, entry in s["acceptance"].items():
                    als = " ".join(f"{entry[f'k{k}']['mean_acceptance_length']:.2f}" for k in range(1, 6) if f"k{k}" in entry)
                    rc = entry.get("ref_check", {})
                    ref = f" | ref k3 {rc['reference_mean_acceptance_length']:.2f} vs {rc['replayed_mean_acceptance_length']:.2f}" if rc else ""
                    lines.append(f"{name:<24} {set_name:<8} mean acc len k=1..5: {als}  "
                                 f"(rate k3 {entry['k3']['acceptance_rate']:.3f}){ref}  [{s['steps']} steps, {s['train_seconds']}s]")
        else:
            lines.append(f"{stage}: {json.dumps(res)[:300]}")
    return "\n".join(lines)


def pack(run: Run, tag: str) -> list[Path]:
    """Tar.gz of what this call produced, in 15 MiB parts, plus the report: at most 8 files."""
    run.out.mkdir(parents=True, exist_ok=True)
    archive = run.work / f"zoo-{tag}.tar.gz"
    with tarfile.open(archive, "w:gz", compresslevel=1) as tar:
        for path in dict.fromkeys(run.produced):
            if path.exists():
                tar.add(path, arcname=str(path.relative_to(run.work)))
    part, files = 15 * 2**20, []
    with open(archive, "rb") as f:
        for i, chunk in enumerate(iter(lambda: f.read(part), b"")):
            files.append(run.out / f"{archive.name}.part{i:02d}")
            files[-1].write_bytes(chunk)
    if len(files) > 7 or archive.stat().st_size > 60 * 2**20:
        run.log(f"WARNING: output {archive.stat().st_size / 2**20:.1f} MiB in {len(files)} parts exceeds what the device returns")
    return files


def main() -> int:
    run = Run()
    plan = [s for s in env("ZOO_STAGES", "tiny-target,tiny-regen,tiny-drafts").split(",") if s]
    unknown = set(plan) - set(STAGES)
    if unknown:
        raise SystemExit(f"unknown stages {unknown}; choose from {STAGES}")
    import torch

    run.report.update(plan=plan, device=torch.cuda.get_device_name() if run.device.startswith("cuda") else "cpu")
    gather_carried(run)
    failed = False
    for stage in plan:
        run.log(f"stage {stage} ({(run.deadline - time.time()) / 60:.1f} min left)")
        try:
            run.report["stages"][stage] = globals()["stage_" + stage.replace("-", "_")](run)
        except Exception as e:  # keep going: later stages and the packing still run
            failed = True
            run.report["stages"][stage] = {"error": f"{type(e).__name__}: {e}"}
            run.log(f"stage {stage} FAILED: {type(e).__name__}: {e}")
            import traceback

            traceback.print_exc()
        free_gpu()
    run.report["seconds"] = time.time() - run.t0
    text = table(run.report)
    (run.work / "logs" / "zoo_report.json").write_text(json.dumps(run.report, indent=2, default=str))
    run.produced.append(run.work / "logs" / "zoo_report.json")
    files = pack(run, env("ZOO_TAG", "run"))
    run.out.mkdir(parents=True, exist_ok=True)
    (run.out / "zoo_report.txt").write_text(text + "\n")
    print(text, flush=True)
    run.log(f"packed {[f.name for f in files]} into {run.out}; reassemble with: cat zoo-*.tar.gz.part* | tar xz")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
