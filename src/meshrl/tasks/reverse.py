"""String reversal: prompt 'abc=' → answer 'cba'. Verifiable, needs no data download, and a tiny model can
learn it in minutes on a CPU."""

from __future__ import annotations

import random

from meshrl.tasks.base import Example, Task
from meshrl.tokenizer import CharTokenizer


def make_reverse_examples(n: int, *, alphabet: str, min_len: int, max_len: int, rng: random.Random) -> list[Example]:
    out = []
    for _ in range(n):
        s = "".join(rng.choice(alphabet) for _ in range(rng.randint(min_len, max_len)))
        out.append(Example(prompt=s + "=", answer=s[::-1]))
    return out


def build_reverse_task(cfg) -> Task:  # cfg: meshrl.config.TaskConfig
    rng = random.Random(cfg.seed)
    train = make_reverse_examples(
        cfg.num_train, alphabet=cfg.alphabet, min_len=cfg.min_len, max_len=cfg.max_len, rng=rng
    )
    seen = {e.prompt for e in train}
    eval_: list[Example] = []
    # Held-out means held out: no eval prompt appears in the training set (when the space allows it).
    for _ in range(50 * cfg.num_eval):
        if len(eval_) == cfg.num_eval:
            break
        (e,) = make_reverse_examples(1, alphabet=cfg.alphabet, min_len=cfg.min_len, max_len=cfg.max_len, rng=rng)
        if e.prompt not in seen:
            seen.add(e.prompt)
            eval_.append(e)
    if len(eval_) < cfg.num_eval:
        raise ValueError(
            f"task 'reverse' could only find {len(eval_)} held-out prompts not in the {cfg.num_train} training "
            f"prompts; lower task.num_train or raise task.max_len / enlarge task.alphabet"
        )
    return Task(
        name="reverse",
        tokenizer=CharTokenizer(cfg.alphabet + "="),
        train=train,
        eval=eval_,
        reward_weights=dict(cfg.reward_weights),
    )
