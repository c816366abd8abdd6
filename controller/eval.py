"""Evaluate a checkpoint on a task's held-out rows, as RL papers report it — no trainer, just generators and
reward processes.

    python -m meshrl.controller.eval --model.path runs/rl1/final_model --data.eval test.jsonl --eval.samples 8
    python -m meshrl.controller.eval --model.path ./my-llama --task reasoning_gym:countdown --eval.samples 16
    python -m meshrl.controller.eval --model.path runs/calc/final_model --env calculator --env.max-turns 3

Greedy accuracy, mean reward, and with --eval.samples k: mean@k and pass@k (unbiased estimator) over k samples at
--generator.temperature. Correct means the verifier (--eval.verifier, default the task's) gives >= 1. Writes
eval.json (and the first completions) into the run directory.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence

from meshrl.config import EvalRunConfig
from meshrl.controller.api import Controller
from meshrl.controller.grpo import describe_eval
from meshrl.controller.process import prepare_process
from meshrl.controller.provision import Provisioner
from meshrl.controller.rollouts import EnvRollout, SingleTurnRollout, evaluate
from meshrl.errors import ConfigError, DataError
from meshrl.preflight import check_run_inputs
from meshrl.run_dir import RunDir
from meshrl.tasks import Row, build_data_task, build_task
from meshrl.tasks.setup import TaskSetup


def main(
    cfg: EvalRunConfig,
    *,
    eval_rows: Sequence[dict | Row] | None = None,
    reward_fns: Mapping[str, Callable] | None = None,
) -> dict:
    if cfg.model.path is None:
        raise ConfigError("evaluation needs --model.path: the HF checkpoint dir to evaluate")
    check_run_inputs(cfg)
    run = RunDir(cfg.run.output_dir, cfg.run.name, cfg)
    if cfg.task in (None, "data") and (eval_rows is not None or cfg.data.eval is not None):
        # Held-out rows only: they stand in for the data task's training rows too (nothing trains here).
        source = eval_rows if eval_rows is not None else cfg.data.eval
        from meshrl.data.roles import accepted_roles

        roles = accepted_roles(cfg.model.path)  # the chat roles the model's template knows, as for grpo
        task = build_data_task(cfg.data, train_rows=source, eval_rows=source, roles=roles)
    else:
        task = build_task(cfg)
    max_tokens = cfg.eval.max_tokens or cfg.generator.max_tokens
    setup = TaskSetup.prepare(cfg, task, cfg.model.path, reward_fns=reward_fns, eval_max_tokens=max_tokens)
    if cfg.env.name:  # episodes of an environment (its rewards, plus --reward's rubric if given)
        source = EnvRollout(cfg.env, setup, max_model_len=cfg.generator.max_model_len,
                            turn_max_tokens=cfg.generator.max_tokens)  # fmt: skip
    else:
        source = SingleTurnRollout(setup, max_tokens)
    print(
        f"[meshrl] evaluating {cfg.model.path} on task {task.name}: {setup.eval.describe('eval')}; correct = "
        f"{setup.verifier} >= 1; {cfg.generator.num_replicas} generator + "
        f"{0 if setup.rewards is None else cfg.scoring.num_procs} reward processes",
        flush=True,
    )
    prepare_process()  # then the generator and reward processes placed (cfg.placement) and started; no trainer
    provision = Provisioner(cfg.placement)
    with Controller.start(cfg, rewards=setup.rewards, tokenizer=setup.renderer.tokenizer, provision=provision) as ctl:
        record = evaluate(
            ctl, setup, cfg.eval, max_tokens=max_tokens, temperature=cfg.generator.temperature,
            top_p=cfg.generator.top_p, top_k=cfg.generator.top_k, source=source,
        )  # fmt: skip
    result = {"model": cfg.model.path, "task": task.name, "num_prompts": len(setup.eval), **record}
    path = run.write_json("eval.json", result)
    print(f"[meshrl] {describe_eval(record)}, mean reward {record['reward_mean']:.3f}\n[meshrl] written: {path}")
    run.close()
    return result


if __name__ == "__main__":
    from meshrl.controller.cli import parse_run_config, stop_on_sigterm

    stop_on_sigterm()
    try:
        main(parse_run_config(EvalRunConfig, description=__doc__))
    except (ConfigError, DataError) as e:  # found as the task, model and rewards load, before any process starts
        sys.exit(f"config error: {e}" if isinstance(e, ConfigError) else f"data error: {e}")
    except KeyboardInterrupt:
        sys.exit(130)
