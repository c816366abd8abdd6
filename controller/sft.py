"""Supervised fine-tuning on Monarch meshes — the whole loop, top to bottom.

    python -m meshrl.controller.sft [--sft.max-steps 200 --data.train rows.jsonl --model.path ckpt ...]

batch of (prompt, response) rows → forward_backward over micro-batches with cross-entropy on the response
tokens (normalised by the step's total response tokens; the last call takes the optimiser step, lr from the
schedule) → log; evaluate
every `eval_every` steps; write a resumable checkpoint every `run.save_every` steps; export HF weights at the end.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from typing import Any

from meshrl.config import EvalConfig, SFTRunConfig
from meshrl.controller.api import Controller, padding_id
from meshrl.controller.process import prepare_process
from meshrl.controller.provision import Provisioner
from meshrl.controller.rollouts import evaluate
from meshrl.controller.run_checkpoints import RunCheckpoints, RunFailedError
from meshrl.controller.training import eval_nll, pad_rows, train_step
from meshrl.data.sft import EpochSampler, SFTDataset, load_sft_dataset, pack_examples
from meshrl.metric_sinks import open_sinks
from meshrl.models.hf_config import max_positions
from meshrl.models.qwen3 import read_hf_config
from meshrl.preflight import check_run_inputs
from meshrl.progress import progress
from meshrl.run_dir import RunDir
from meshrl.schedule import optim_params
from meshrl.tasks import Row, Task, build_task
from meshrl.tasks.setup import TaskSetup, ensure_model
from meshrl.types import Datum, LossSpec


def load_data(
    cfg: SFTRunConfig, task: Task | None, model_dir: str, tokenizer, train_rows: list | None, eval_rows: list | None
) -> tuple[SFTDataset, SFTDataset | None]:
    max_len = cfg.data.max_seq_len or max_positions(read_hf_config(model_dir))
    d = cfg.data
    kw = dict(
        max_seq_len=max_len,
        on_bad_row=d.on_bad_row,
        prompt_field=d.prompt_field,
        response_field=d.response_field,
        messages_field=d.messages_field,
    )
    chat = getattr(tokenizer, "chat_template", None) is not None

    def task_row(row: Row) -> dict:
        # Rendered as RL renders it: one user turn through the chat template when the model has one.
        messages = [{"role": "user", "content": row.prompt}] if isinstance(row.prompt, str) else list(row.prompt)
        if chat:
            return {"messages": [*messages, {"role": "assistant", "content": task.demonstration(row)}]}
        return {"prompt": row.prompt, "response": task.demonstration(row)}

    def rows(source: str | None, given: list | None, task_rows) -> Any:
        if given is not None:
            return given
        if source == "task":
            return [task_row(r) for r in task_rows]
        return source

    from meshrl.models.vision import VisionInputs

    kw["vision"] = VisionInputs.from_model_dir(model_dir)  # None for a text-only model
    train = load_sft_dataset(rows(d.train, train_rows, task.train if task else None), tokenizer, **kw)
    eval_source = rows(d.eval, eval_rows, task.eval if task else None)
    return train, (load_sft_dataset(eval_source, tokenizer, **kw) if eval_source is not None else None)


def to_data(dataset: SFTDataset, indices: list[int]) -> list[Datum]:
    out = []
    for i in indices:
        ex = dataset.examples[i]
        datum = Datum.from_completion(ex.prompt_ids, ex.response_ids)
        datum.images = ex.images or None
        out.append(datum)
    return out


def main(cfg: SFTRunConfig, *, train_rows: list | None = None, eval_rows: list | None = None) -> dict:
    check_run_inputs(cfg, generator=cfg.sft.eval_generate and eval_rows is None and cfg.data.eval == "task")
    run = RunDir(cfg.run.output_dir, cfg.run.name, cfg)
    run.add_sink(*open_sinks(cfg.log, run.path, cfg))  # every record also to TensorBoard (tb/), wandb, ...
    uses_task = train_rows is None and cfg.data.train == "task" or eval_rows is None and cfg.data.eval == "task"
    task = build_task(dataclasses.replace(cfg, task=cfg.task or "reverse")) if uses_task else None
    model_dir = ensure_model(cfg, task, run.path)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    train, held_out = load_data(cfg, task, model_dir, tokenizer, train_rows, eval_rows)
    for name, ds in (("train", train), ("eval", held_out)):
        if ds is not None and ds.skipped:
            print(f"[meshrl] {name} data {ds.source}: skipped {sum(ds.skipped.values())} bad rows: {dict(ds.skipped)}")
    is_task_eval = held_out is not None and eval_rows is None and cfg.data.eval == "task"
    generate_eval = cfg.sft.eval_generate and is_task_eval
    setup = TaskSetup.prepare(cfg, task, model_dir) if generate_eval else None
    ckpts = RunCheckpoints("sft", run, cfg)
    sampler, start = EpochSampler(len(train), seed=cfg.data.shuffle_seed), 0
    steps_per_epoch = len(train) / cfg.sft.batch_size
    total = cfg.sft.max_steps
    if cfg.sft.max_epochs is not None:
        total = min(total, math.ceil(cfg.sft.max_epochs * steps_per_epoch))
    dp, micro = cfg.trainer.num_procs, cfg.trainer.micro_batch_size
    pack_len = cfg.data.pack_len or cfg.data.max_seq_len or max_positions(read_hf_config(model_dir))
    pad_id = padding_id(tokenizer, model_dir)
    print(
        f"[meshrl] SFT: {len(train)} train rows, {len(held_out) if held_out else 0} eval rows, {total} steps "
        f"({total / steps_per_epoch:.2f} epochs); run dir {run.path}"
    )

    prepare_process()  # then every role's processes placed (cfg.placement) and started
    provision = Provisioner(cfg.placement)
    with ckpts.starting():  # a host lost while the processes start ends the run with the resume hint
        ctl = Controller.start(
            cfg, model_dir=model_dir, rewards=setup.rewards if setup else None, tokenizer=tokenizer,
            provision=provision, generate=generate_eval,
        )  # fmt: skip
    with ctl, ckpts.resume_hint_on_failure(), run.sinks_open():
        print(f"[meshrl] trainer processes (pids): {ctl.trainer_pids}", flush=True)
        if resumed := ckpts.restore(ctl):  # trainer model + optimiser; the data cursor below
            sampler, start = EpochSampler.from_state(len(train), resumed["sampler"]), resumed["step"]
            print(f"[meshrl] data: epoch {sampler.epochs_done:.2f}")

        def run_eval(step: int) -> dict:
            record: dict[str, Any] = {"phase": "eval", "step": step}
            if held_out is not None:
                record["eval_loss"] = eval_nll(ctl, to_data(held_out, list(range(len(held_out)))), micro, dp)
            if generate_eval:
                ctl.sync_weights()
                record["accuracy"] = evaluate(
                    ctl, setup, EvalConfig(), max_tokens=cfg.generator.max_tokens, temperature=1.0
                )["accuracy"]
            run.log(record)
            return record

        bar = progress(range(start, total), desc="SFT", initial=start, total=total)
        for step in bar:
            t0 = time.perf_counter()
            indices = sampler.next_indices(cfg.sft.batch_size)
            if cfg.data.pack:
                rows = pack_examples([train.examples[i] for i in indices], pack_len)
                data = pad_rows(rows, dp, pad_id)
            else:
                data = to_data(train, indices)
            loss = LossSpec("cross_entropy", num_loss_tokens=sum(d.num_loss_tokens for d in data))
            params = optim_params(cfg.optim, step, total)
            results, opt, _ = train_step(ctl, data, loss, micro, params)
            train_loss = sum(r.loss for r in results)
            run.log(
                {
                    "phase": "sft",
                    "step": step,
                    "loss": train_loss,
                    "grad_norm": opt.grad_norm,
                    "lr": params.lr,
                    "epoch": sampler.epochs_done,
                    "policy_version": opt.policy_version,
                    "rows": len(data),
                    "tokens_per_s": sum(len(d.tokens) for d in data) / (time.perf_counter() - t0),
                }
            )
            bar.set_postfix(loss=f"{train_loss:.4f}")
            done = step + 1
            if cfg.sft.eval_every and done % cfg.sft.eval_every == 0 and done < total:
                run_eval(done)
            if stopped := ckpts.after_step(ctl, done, total, lambda: {"sampler": sampler.state()}):
                return {"stopped_at": done, "checkpoint": stopped, "run_dir": str(run.path)}
        final_eval = run_eval(total)
        last_ckpt = ckpts.save(ctl, total, {"sampler": sampler.state()})
        final_dir = ctl.export_hf(str(run.path / "final_model"))

    summary = {
        "steps": total,
        "final_eval": final_eval,
        "final_checkpoint": last_ckpt,
        "final_model": final_dir,
        "run_dir": str(run.path),
        "metrics": str(run.metrics_path),
    }
    run.write_json("summary.json", summary)
    print(
        f"[meshrl] final eval: {final_eval}\n[meshrl] metrics:    {run.metrics_path}\n"
        f"[meshrl] checkpoint: {last_ckpt} (resumable)\n[meshrl] model:      {final_dir} (HF format)"
    )
    return summary


if __name__ == "__main__":
    from meshrl.controller.cli import parse_run_config, stop_on_sigterm
    from meshrl.errors import ConfigError, DataError

    stop_on_sigterm()
    try:
        main(parse_run_config(SFTRunConfig, description=__doc__))
    except RunFailedError as e:
        sys.exit(f"[meshrl] {e}")
    except (ConfigError, DataError) as e:  # found as the task, model and rewards load, before any process starts
        sys.exit(f"config error: {e}" if isinstance(e, ConfigError) else f"data error: {e}")
    except KeyboardInterrupt:
        sys.exit(130)
