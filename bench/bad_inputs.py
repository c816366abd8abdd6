"""Bad inputs through the real command line: is each refused at once, before any actor process starts, with a message
that names the file / row / flag at fault? (issue 18: "bad inputs tried / clear")

    .venv/bin/python bench/bad_inputs.py            # prints the table, writes bench/results/bad_inputs-cpu.json

Every case runs `python -m meshrl.controller.grpo` or `meshrl.controller.sft` as a subprocess with a tiny preset in a
temporary directory, where the damaged checkpoints and data files are made (a tiny Qwen3 with a character tokenizer,
then copies of it with a corrupt config.json or a truncated safetensors file). A case is clear when the program exits
non-zero, the error names everything the case lists, and no actor process was started (neither the "[meshrl]
starting" line nor a "trainer processes" line appears).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STARTED = ("[meshrl] starting", "trainer processes")
BOX = re.compile(r"[│╭╮╰╯─]+")


@dataclass
class Case:
    name: str
    program: str  # "grpo" | "sft"
    args: list[str]
    names: list[str]  # what the error must name (file, row, flag, value)
    what: str = ""  # which input of the issue this is


@dataclass
class Result:
    input: str
    program: str
    exit_code: int
    seconds: float
    error: str
    names: list[str]
    names_found: dict[str, bool] = field(default_factory=dict)
    names_all: bool = False
    processes_started: bool = False
    clear: bool = False


def make_inputs(tmp: Path) -> dict[str, Path]:
    """The tiny model, its damaged copies, and the data files, all under `tmp`."""
    from meshrl.models.qwen3 import create_random_checkpoint
    from meshrl.tokenizer import CharTokenizer

    good = create_random_checkpoint(tmp / "model", flavor="tiny", tokenizer=CharTokenizer("abcdefgh="), seed=0)
    paths = {"model": good}

    def copy(name: str) -> Path:
        shutil.copytree(good, tmp / name)
        return tmp / name

    paths["config_not_json"] = copy("config_not_json")
    (paths["config_not_json"] / "config.json").write_text('{"model_type": "qwen3", "vocab_size": 13,\n')
    paths["config_no_model_type"] = copy("config_no_model_type")
    cfg = json.loads((good / "config.json").read_text())
    cfg.pop("model_type")
    (paths["config_no_model_type"] / "config.json").write_text(json.dumps(cfg))
    paths["truncated"] = copy("truncated")
    weights = paths["truncated"] / "model.safetensors"
    with weights.open("r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    paths["header_not_json"] = copy("header_not_json")
    weights = paths["header_not_json"] / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[8:16] = b"\xff\xfenot js"
    weights.write_bytes(bytes(data))

    good_rows = [{"prompt": "abc=", "response": "cba"}, {"prompt": "de=", "response": "ed"}]
    lines = [json.dumps(r).encode() for r in good_rows]
    paths["sft_good"] = tmp / "sft_good.jsonl"
    paths["sft_good"].write_bytes(b"\n".join(lines) + b"\n")
    paths["sft_not_utf8"] = tmp / "sft_not_utf8.jsonl"
    paths["sft_not_utf8"].write_bytes(
        b"\n".join([lines[0], b'{"prompt": "ab\xff=", "response": "ba"}', lines[1]]) + b"\n"
    )
    paths["sft_unknown_chars"] = tmp / "sft_unknown_chars.jsonl"
    unknown = json.dumps({"prompt": "abé=", "response": "éba"}, ensure_ascii=False).encode()
    paths["sft_unknown_chars"].write_bytes(b"\n".join([lines[0], lines[1], unknown]) + b"\n")
    prompt_lines = [json.dumps({"prompt": "What is 1 + 1?", "answer": "2"}).encode()] * 2
    paths["prompts_good"] = tmp / "prompts_good.jsonl"
    paths["prompts_good"].write_bytes(b"\n".join(prompt_lines) + b"\n")
    paths["prompts_not_utf8"] = tmp / "prompts_not_utf8.jsonl"
    bad_prompt = b'{"prompt": "What is 2 \xe9 2?", "answer": "4"}'
    paths["prompts_not_utf8"].write_bytes(b"\n".join([prompt_lines[0], bad_prompt, prompt_lines[1]]) + b"\n")
    return paths


def cases(p: dict[str, Path]) -> list[Case]:
    grpo = ["--preset", "tiny-reverse", "--grpo.steps", "1"]
    sft = ["--preset", "tiny-reverse-sft", "--sft.max-steps", "2"]
    own_sft = ["--model.path", str(p["model"]), "--data.eval", "None", "--sft.max-steps", "2"]
    return [
        Case("config.json not JSON", "grpo", ["--model.path", str(p["config_not_json"])] + grpo,
             [str(p["config_not_json"] / "config.json"), "not valid JSON"], "1"),
        Case("config.json without model_type", "grpo", ["--model.path", str(p["config_no_model_type"])] + grpo,
             [str(p["config_no_model_type"] / "config.json"), "model_type"], "1"),
        Case("truncated model.safetensors", "grpo", ["--model.path", str(p["truncated"])] + grpo,
             [str(p["truncated"] / "model.safetensors"), "truncated"], "2"),
        Case("safetensors header not JSON", "grpo", ["--model.path", str(p["header_not_json"])] + grpo,
             [str(p["header_not_json"] / "model.safetensors"), "not JSON"], "2"),
        Case("non-UTF-8 byte in SFT JSONL", "sft", own_sft + ["--data.train", str(p["sft_not_utf8"])],
             [str(p["sft_not_utf8"]), "row 2", "UTF-8", "--data.on-bad-row skip"], "3"),
        Case("non-UTF-8 byte in GRPO prompt JSONL", "grpo",
             ["--data.train", str(p["prompts_not_utf8"]), "--data.eval", str(p["prompts_good"]), "--grpo.steps", "1"],
             [str(p["prompts_not_utf8"]), "row 2", "UTF-8", "--data.on-bad-row skip"], "3"),
        Case("SFT text outside the tokenizer's alphabet", "sft",
             own_sft + ["--data.train", str(p["sft_unknown_chars"])],
             [str(p["sft_unknown_chars"]), "row 3", "'é'", "vocabulary"], "4"),
        Case("--data.max-seq-len 4096 > context 256", "sft", sft + ["--data.max-seq-len", "4096"],
             ["--data.max-seq-len", "4096", "256"], "5"),
        Case("--trainer.num-procs 64 on this CPU", "grpo", grpo + ["--trainer.num-procs", "64"],
             ["--trainer.num-procs", "64", f"{len(os.sched_getaffinity(0))} CPU core"], "6"),
        Case("--grpo.kl-estimator k1 without kl-coef", "grpo", grpo + ["--grpo.kl-estimator", "k1"],
             ["--grpo.kl-estimator", "--grpo.kl-coef"], "7"),
        Case("--grpo.kl-mode reward without kl-coef", "grpo", grpo + ["--grpo.kl-mode", "reward"],
             ["--grpo.kl-mode", "--grpo.kl-coef"], "7"),
        Case("--grpo.reference-procs 2 without kl-coef", "grpo", grpo + ["--grpo.reference-procs", "2"],
             ["--grpo.reference-procs", "--grpo.kl-coef"], "7"),
        Case("--generator.max-tokens 0", "grpo", grpo + ["--generator.max-tokens", "0"],
             ["generator.max_tokens=0", "[1, 31]"], "8"),
        # Siblings found on the way.
        Case("--eval.max-tokens 64 > max-model-len 32", "grpo", grpo + ["--eval.max-tokens", "64"],
             ["eval.max_tokens=64", "generator.max_model_len=32"], "sibling"),
        Case("--generator.max-model-len 512 > context 256", "grpo", grpo + ["--generator.max-model-len", "512"],
             ["--generator.max-model-len", "512", "256"], "sibling"),
        Case("--data.pack-len without --data.pack", "sft", sft + ["--data.pack-len", "64"],
             ["--data.pack-len", "--data.pack"], "sibling"),
        Case("--generator.top-k 0", "grpo", grpo + ["--generator.top-k", "0"], ["generator.top_k=0"], "sibling"),
    ]  # fmt: skip


def error_text(stderr: str) -> str:
    """The program's error message on one line: "config error: ..." / "data error: ..." as the programs print it,
    tyro's boxed "Error parsing ...", else the last line (a traceback's exception)."""
    lines = [ln.rstrip() for ln in stderr.splitlines() if ln.strip()]
    for ln in lines:
        if ln.startswith(("config error:", "data error:")):
            return ln
    for i, ln in enumerate(lines):
        if "Error parsing" in ln:
            parts = []
            for box_line in lines[i:]:
                text = BOX.sub("", box_line).strip()
                if box_line.lstrip().startswith("│ ─") or text.startswith("For full helptext"):
                    break
                parts.append(text)
            return " ".join(p for p in parts if p)
    return lines[-1] if lines else ""


def run_case(case: Case, tmp: Path, timeout: float) -> Result:
    out_dir = tmp / "runs" / re.sub(r"\W+", "_", case.name)
    cmd = [sys.executable, "-m", f"meshrl.controller.{case.program}", *case.args, "--run.output-dir", str(out_dir)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_LOGGING_LEVEL="ERROR")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=tmp, env=env)
        code, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as e:
        code, stdout, stderr = -1, e.stdout or "", (e.stderr or "") + f"\n(timed out after {timeout:.0f} s)"
        stdout, stderr = (s.decode() if isinstance(s, bytes) else s for s in (stdout, stderr))
    seconds = time.perf_counter() - t0
    error = error_text(stderr)
    # Wrapped lines (tyro's box) join with spaces: compare without whitespace, so a path broken over lines still counts.
    flat = re.sub(r"\s+", "", error)
    found = {n: re.sub(r"\s+", "", n) in flat for n in case.names}
    started = any(s in stdout + stderr for s in STARTED)
    ok = code not in (0, -1) and all(found.values()) and not started
    return Result(case.name, case.program, code, round(seconds, 1), error, case.names, found, all(found.values()),
                  started, ok)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "bad_inputs-cpu.json")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds a case may take before it counts as a hang")
    ap.add_argument("--only", default="", help="run the cases whose name contains this text")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="meshrl-bad-inputs-") as d:
        tmp = Path(d)
        paths = make_inputs(tmp)
        results = []
        for case in cases(paths):
            if args.only and args.only not in case.name:
                continue
            r = run_case(case, tmp, args.timeout)
            results.append(r)
            print(f"[{'clear' if r.clear else 'NOT CLEAR'}] {r.input}: exit {r.exit_code} in {r.seconds} s", flush=True)
    clear = sum(r.clear for r in results)
    print(f"\n{'input':44} {'exit':>4} {'s':>5}  names  procs  clear  error (first line)")
    for r in results:
        err = r.error.replace(tmp.as_posix(), "$TMP")
        print(
            f"{r.input:44} {r.exit_code:>4} {r.seconds:>5.1f}  {'yes' if r.names_all else 'NO':5}  "
            f"{'YES' if r.processes_started else 'no':5}  {'yes' if r.clear else 'NO':5}  {err[:160]}"
        )
    print(f"\nbad inputs tried / clear: {len(results)} / {clear}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "machine": {"cpus": len(os.sched_getaffinity(0)), "python": sys.version.split()[0]},
        "date": time.strftime("%Y-%m-%d"),
        "tried": len(results),
        "clear": clear,
        "cases": [{**asdict(r), "error": r.error.replace(tmp.as_posix(), "$TMP")} for r in results],
    }
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
