"""Trainer backend 'hf' (a transformers model under FSDP2) on a real 2-process Monarch mesh: the same
logprobs, gradients and updates as the torchtitan backend on the same checkpoint, and k micro-batches equal
one big batch. Both trainers live in the same two processes (one process group, two models)."""

from __future__ import annotations

import pytest
import torch
from conftest import random_data

from meshrl.config import ModelConfig, TrainerConfig
from meshrl.types import LossSpec, OptimParams

LINEAR_ADAM = OptimParams(lr=1.0, eps=1e3, grad_clip=0.0)  # an SGD step: compares accumulated gradients
TIMEOUT = 120


class Trainer:
    """The PolicyTrainer endpoints of one actor mesh, waited on with a timeout, rank 0's answer."""

    def __init__(self, mesh) -> None:
        self.mesh = mesh

    def _get(self, fut):
        return next(iter(fut.get(timeout=TIMEOUT).values()))

    def forward(self, data, temperature=1.0):
        return self._get(self.mesh.forward.call(data, temperature))

    def forward_backward(self, data, spec):
        return self._get(self.mesh.forward_backward.call(data, spec))

    def optim_step(self, params):
        return self._get(self.mesh.optim_step.call(params))

    def reload(self, path):  # fresh weights and optimiser (the endpoint is `load_hf` / `load_checkpoint`)
        ep = getattr(self.mesh, "load_hf", None) or self.mesh.load_checkpoint
        return self._get(ep.call(path))


@pytest.fixture(scope="module")
def trainers(base_model_dir):
    from monarch.actor import this_host
    from monarch.spmd import setup_torch_elastic_env

    from meshrl.actors import PolicyTrainer

    procs = this_host().spawn_procs(per_host={"procs": 2})
    setup_torch_elastic_env(procs)
    tcfg = TrainerConfig(num_procs=2, micro_batch_size=4)
    out = {}
    models = {
        "torchtitan": ModelConfig(),
        "hf": ModelConfig(backend="hf"),
        "lora": ModelConfig(backend="hf", lora_rank=4, lora_alpha=8.0),
    }
    for name, mcfg in models.items():  # one after the other: they share the process group
        mesh = procs.spawn(f"trainer_{name}", PolicyTrainer, base_model_dir, mcfg, tcfg, 0)
        mesh.setup.call().get(timeout=TIMEOUT)
        out[name] = Trainer(mesh)
    yield out
    procs.stop().get(timeout=60)


def _flat(rows):
    return torch.tensor([x for r in rows for x in r])


def test_hf_backend_matches_torchtitan_logprobs_grads_and_update(trainers, base_model_dir):
    titan, hf = trainers["torchtitan"], trainers["hf"]
    probe = random_data(4, seed=7)
    torch.testing.assert_close(_flat(hf.forward(probe)), _flat(titan.forward(probe)), rtol=0, atol=2e-6)
    torch.testing.assert_close(_flat(hf.forward(probe, 0.7)), _flat(titan.forward(probe, 0.7)), rtol=0, atol=2e-6)

    data = random_data(8, seed=8)
    spec = LossSpec("grpo", num_loss_tokens=sum(d.num_loss_tokens for d in data))
    res = {}
    for name, t in trainers.items():
        t.reload(base_model_dir)
        fb = t.forward_backward(data, spec)
        res[name] = (fb, t.optim_step(LINEAR_ADAM), _flat(t.forward(probe)))
    (fb_t, opt_t, after_t), (fb_h, opt_h, after_h) = res["torchtitan"], res["hf"]
    assert fb_h.loss == pytest.approx(fb_t.loss, rel=1e-5, abs=1e-7)
    assert fb_h.num_tokens == fb_t.num_tokens == spec.num_loss_tokens
    assert opt_h.grad_norm == pytest.approx(opt_t.grad_norm, rel=1e-5)
    torch.testing.assert_close(after_h, after_t, rtol=0, atol=1e-5)
    assert (after_h - _flat(hf.forward(probe))).abs().max() == 0  # forward is deterministic
    hf.reload(base_model_dir)
    assert (after_h - _flat(hf.forward(probe))).abs().max() > 1e-3  # the step moved the weights


def test_hf_backend_micro_batches_equal_one_big_batch(trainers, base_model_dir):
    hf = trainers["hf"]
    data = random_data(8, seed=1)
    probe = random_data(4, seed=2)
    spec = LossSpec("grpo", num_loss_tokens=sum(d.num_loss_tokens for d in data))

    hf.reload(base_model_dir)
    big = hf.forward_backward(data, spec)
    g_big = hf.optim_step(LINEAR_ADAM).grad_norm
    w_big = _flat(hf.forward(probe))

    hf.reload(base_model_dir)
    futs = [hf.mesh.forward_backward.call(data[i : i + 2], spec) for i in range(0, 8, 2)]  # k=4, queued at once
    parts = [hf._get(f) for f in futs]
    g_micro = hf.optim_step(LINEAR_ADAM).grad_norm
    w_micro = _flat(hf.forward(probe))

    assert sum(p.loss for p in parts) == pytest.approx(big.loss, rel=1e-5)
    assert g_micro == pytest.approx(g_big, rel=1e-5)
    torch.testing.assert_close(w_micro, w_big, rtol=0, atol=1e-6)


def test_hf_backend_checkpoint_roundtrip_in_transformers(trainers, base_model_dir, tmp_path):
    """What the hf trainer saves loads in transformers with the trainer's logprobs, and loads back."""
    from transformers import AutoModelForCausalLM

    from meshrl.policy import collate, target_logprobs

    hf = trainers["hf"]
    hf.reload(base_model_dir)
    hf.forward_backward(random_data(4, seed=5), LossSpec("cross_entropy", num_loss_tokens=40))
    hf.optim_step(OptimParams(lr=1e-2))
    ep = getattr(hf.mesh, "export_hf", None) or hf.mesh.save_checkpoint
    path = hf._get(ep.call(str(tmp_path / "ckpt")))
    probe = random_data(2, seed=6)
    want = hf.forward(probe)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokens, _ = collate(probe, 0, torch.device("cpu"))
    with torch.no_grad():
        got = target_logprobs(model(tokens).logits, tokens)
    for i, row in enumerate(want):
        torch.testing.assert_close(got[i, : len(row)], torch.tensor(row), rtol=1e-5, atol=1e-5)
    hf.reload(base_model_dir)
    hf.reload(path)
    torch.testing.assert_close(_flat(hf.forward(probe)), _flat(want), rtol=0, atol=0)


def test_lora_trains_adapters_only_and_exports_merged_and_adapter_checkpoints(trainers, base_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from meshrl.models.qwen3 import load_hf_state_dict
    from meshrl.policy import collate

    lora, hf = trainers["lora"], trainers["hf"]
    lora.reload(base_model_dir)
    info = lora._get(lora.mesh.info.call())
    assert 0 < info["num_trainable_params"] < info["num_params"] / 4  # only the adapters are in the optimiser
    probe = random_data(4, seed=11)
    hf.reload(base_model_dir)
    start = _flat(lora.forward(probe))
    torch.testing.assert_close(start, _flat(hf.forward(probe)), rtol=0, atol=2e-6)  # B = 0: the base model
    for step in range(2):
        data = random_data(4, seed=12 + step)
        lora.forward_backward(data, LossSpec("cross_entropy", num_loss_tokens=sum(d.num_loss_tokens for d in data)))
        lora.optim_step(OptimParams(lr=3e-2))
    trained = lora.forward(probe)
    assert (_flat(trained) - start).abs().max() > 1e-3

    merged_dir = lora._get(lora.mesh.export_hf.call(str(tmp_path / "merged")))
    adapter_dir = lora._get(lora.mesh.export_adapter.call(str(tmp_path / "adapter")))
    base, merged = load_hf_state_dict(base_model_dir), load_hf_state_dict(merged_dir)
    assert merged.keys() == base.keys()  # the base model's names, no adapter tensors
    changed = {k for k in base if not torch.equal(base[k], merged[k])}
    assert changed and all(k.endswith("proj.weight") for k in changed)  # norms and embeddings never train

    tokens, _ = collate(probe, 0, torch.device("cpu"))
    merged_model = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    base_model = AutoModelForCausalLM.from_pretrained(base_model_dir, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base_model, adapter_dir).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged_model(tokens).logits, peft_model(tokens).logits, rtol=1e-5, atol=1e-5)
        got = torch.log_softmax(merged_model(tokens).logits[:, :-1], -1).gather(-1, tokens[:, 1:, None])[..., 0]
    for i, row in enumerate(trained):
        torch.testing.assert_close(got[i, : len(row)], torch.tensor(row), rtol=1e-5, atol=1e-5)


def test_backend_is_validated():
    from meshrl.config import ConfigError

    with pytest.raises(ConfigError, match="model.backend='jax'"):
        ModelConfig(backend="jax")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="needs model.backend='hf'"):
        ModelConfig(lora_rank=8)
    assert ModelConfig(backend="hf", lora_rank=8, lora_target_modules="q_proj, v_proj").lora_options()[
        "target_modules"
    ] == ["q_proj", "v_proj"]
