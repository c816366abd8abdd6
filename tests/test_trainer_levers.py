"""Trainer speed levers against the plain path, at library level (a 1-process gloo group, no Monarch):
chunked linear logprobs (values and gradients, alone and through both backends) and activation checkpointing
give the same logprobs and gradients as the full-logits, no-recompute path, to float32 rounding."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import random_data
from torch.distributed.tensor import DTensor

from meshrl.config import ConfigError, GRPORunConfig, ModelConfig, TrainerConfig
from meshrl.models.logprobs import chunked_linear_logprobs, target_logprobs
from meshrl.models.sharding import full_tensor
from meshrl.types import LossSpec

torch.set_num_threads(1)
ATOL = 2e-6


@pytest.mark.parametrize("keep_logits", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_chunked_linear_logprobs_equals_full_logits(temperature, chunk, keep_logits):
    g = torch.Generator().manual_seed(0)
    B, L, H, V = 3, 7, 16, 29
    hidden = torch.randn(B, L, H, generator=g, dtype=torch.float64).float().requires_grad_()
    weight = torch.randn(V, H, generator=g).requires_grad_()
    bias = torch.randn(V, generator=g).requires_grad_()
    tokens = torch.randint(0, V, (B, L), generator=g)
    upstream = torch.randn(B, L - 1, generator=g)

    want = target_logprobs(torch.nn.functional.linear(hidden, weight, bias), tokens, temperature)
    (want * upstream).sum().backward()
    want_grads = [t.grad.clone() for t in (hidden, weight, bias)]
    for t in (hidden, weight, bias):
        t.grad = None

    got = chunked_linear_logprobs(
        hidden[:, :-1], weight, bias, tokens[:, 1:], temperature=temperature, chunk_size=chunk, keep_logits=keep_logits
    )
    (got * upstream).sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=ATOL)  # float32 rounding of logsumexp vs log_softmax
    for name, t, w in zip(("hidden", "weight", "bias"), (hidden, weight, bias), want_grads, strict=True):
        torch.testing.assert_close(t.grad, w, rtol=1e-5, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")


def test_chunked_linear_logprobs_no_bias_bf16_weight():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 9, 32, generator=g).bfloat16()
    weight = torch.randn(50, 32, generator=g).bfloat16()
    tokens = torch.randint(0, 50, (2, 9), generator=g)
    want = target_logprobs(hidden @ weight.t(), tokens)  # bf16 logits upcast, as the models' heads
    got = chunked_linear_logprobs(hidden[:, :-1], weight, None, tokens[:, 1:], chunk_size=4)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    kept = chunked_linear_logprobs(hidden[:, :-1], weight, None, tokens[:, 1:], chunk_size=4, keep_logits=True)
    torch.testing.assert_close(kept, got, rtol=0, atol=0)  # the same matmul, written into the kept buffer
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_linear_logprobs(hidden[:, :-1], weight, None, tokens[:, 1:], chunk_size=0)


def test_trainer_config_levers():
    with pytest.raises(ConfigError, match="logprob_chunk_size"):
        TrainerConfig(num_procs=1, micro_batch_size=2, logprob_chunk_size=-1)
    with pytest.raises(ConfigError, match="logprob_keep_logits.*logprob_chunk_size > 0"):
        TrainerConfig(num_procs=1, micro_batch_size=2, logprob_keep_logits=True)
    bf16 = TrainerConfig(num_procs=1, micro_batch_size=2, master_dtype="bfloat16")
    with pytest.raises(ConfigError, match="master_dtype='bfloat16' with model.dtype='float32'.*--model.dtype bfloat16"):
        GRPORunConfig(trainer=bf16)
    GRPORunConfig(trainer=bf16, model=ModelConfig(dtype="bfloat16"))


# ---- through Policy and both backends ------------------------------------------------------------------------


def _run(model_dir: str, backend: str, **levers):
    """Logprobs of `forward`, and the gradients one `forward_backward` leaves, of a fresh Policy."""
    from meshrl.policy import Policy

    p = Policy.from_options(model_dir, backend=backend, **levers)
    data = random_data(4, seed=3)
    fwd = p.forward(data, temperature=0.8)
    spec = LossSpec("grpo", num_loss_tokens=sum(d.num_loss_tokens for d in data), temperature=0.8, return_logprobs=True)
    fb = p.forward_backward(data, spec)
    grads = {  # AC's wrapper renames parameters (not state-dict keys): compare under the plain names
        n.replace("._checkpoint_wrapped_module", ""): full_tensor(q.grad).clone()
        for n, q in p.model.named_parameters()
        if q.grad is not None
    }
    return fwd, fb, grads


@pytest.mark.parametrize("backend", ["hf", "torchtitan"])
def test_levers_match_the_plain_path(one_rank_group, base_model_dir, backend):
    base_fwd, base_fb, base_grads = _run(base_model_dir, backend)
    assert base_grads
    for levers in (
        {"logprob_chunk_size": 5},
        {"activation_checkpointing": True},
        {"logprob_chunk_size": 3, "activation_checkpointing": True},
        {"logprob_chunk_size": 4, "logprob_keep_logits": True},
    ):
        fwd, fb, grads = _run(base_model_dir, backend, **levers)
        torch.testing.assert_close(torch.tensor(sum(fwd, [])), torch.tensor(sum(base_fwd, [])), rtol=0, atol=ATOL)
        torch.testing.assert_close(
            torch.tensor(sum(fb.logprobs, [])), torch.tensor(sum(base_fb.logprobs, [])), rtol=0, atol=ATOL
        )
        assert fb.loss == pytest.approx(base_fb.loss, abs=1e-6)
        assert grads.keys() == base_grads.keys(), levers
        for name, grad in grads.items():
            torch.testing.assert_close(
                grad, base_grads[name], rtol=1e-4, atol=1e-6, msg=lambda m, lv=levers, n=name: f"{lv} {n}: {m}"
            )


def test_chunked_head_keeps_plain_logits_and_names(one_rank_group, base_model_dir):
    from meshrl.policy import Policy

    plain = Policy.from_options(base_model_dir, backend="hf")
    chunked = Policy.from_options(base_model_dir, backend="hf", logprob_chunk_size=4)
    tokens = torch.tensor([[1, 5, 6, 7, 2]])
    # Disarmed, the patched head is the plain projection; parameter names (checkpoints, weight sync) unchanged.
    torch.testing.assert_close(chunked.backend.logits(tokens), plain.backend.logits(tokens), rtol=0, atol=0)
    assert list(chunked.hf_state_dict()) == list(plain.hf_state_dict())


def test_fused_chunk_math_equals_the_in_place_path(monkeypatch):
    """The per-chunk functions that the compile lever hands to torch.compile (run eagerly here: compiling
    changes code generation, not the math). Full chunks take the static-shape compile, each shorter last chunk
    the dynamic one (its row count changes with every micro-batch)."""
    import meshrl.models.logprobs as lp

    calls = []
    monkeypatch.setattr(lp, "_compiled", lambda name, full: calls.append((name, full)) or lp._FUSED[name])
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(2, 11, 16, generator=g).requires_grad_()
    weight = torch.randn(37, 16, generator=g).requires_grad_()
    tokens = torch.randint(0, 37, (2, 11), generator=g)
    outs = []
    for fused, keep_logits in ((False, False), (True, False), (True, True)):
        out = chunked_linear_logprobs(
            hidden[:, :-1], weight, None, tokens[:, 1:], temperature=0.9, chunk_size=6, fused=fused,
            keep_logits=keep_logits,
        )  # fmt: skip
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        outs.append((out.detach(), hidden.grad.clone(), weight.grad.clone()))
        hidden.grad = weight.grad = None
    for other in outs[1:]:
        for a, b in zip(outs[0], other, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=ATOL)
    # 2 x 10 rows in chunks of 6: 6, 6, 6, 2, forward and backward
    assert calls == [("forward", True)] * 3 + [("forward", False)] + [("backward", True)] * 3 + [
        ("backward", False)
    ] + [("forward", True)] * 3 + [("forward", False)] + [("backward_in_place", True)] * 3 + [
        ("backward_in_place", False)
    ], calls


def test_publish_weights_ipc_serves_the_live_weights(one_rank_group, base_model_dir):
    """Policy -> shared buffer -> TransformersEngine, before and after an optimiser step (CPU backing of the buffer)."""
    from meshrl.generation.transformers_engine import TransformersEngine
    from meshrl.policy import Policy
    from meshrl.types import OptimParams
    from meshrl.weight_sync.shared_buffer import SharedBufferReceiver

    p = Policy.from_options(base_model_dir, backend="hf", logprob_chunk_size=4)
    engine = TransformersEngine(base_model_dir, dtype="float32", max_model_len=32, max_num_seqs=2, device="cpu")
    rx = None
    try:
        for version in (1, 2):
            handle = p.publish_weights_ipc(version, torch.float32)
            rx = rx or SharedBufferReceiver(handle)
            assert rx.load_into(engine, version) == version
            engine_sd = engine.model.state_dict()
            for name, t in p.hf_state_dict().items():
                assert torch.equal(engine_sd[name], t), (version, name)
            data = random_data(2, seed=version)
            p.forward_backward(data, LossSpec("grpo", num_loss_tokens=sum(d.num_loss_tokens for d in data)))
            p.optim_step(OptimParams(lr=1e-2))
    finally:
        if rx is not None:
            rx.close()
        p._ipc_sender.close()
        engine.shutdown()


@pytest.mark.parametrize("backend", ["hf", "torchtitan"])
def test_bf16_master_weights(one_rank_group, base_model_dir, backend):
    """master_dtype='bfloat16': the trained weights and the AdamW state are bf16 (no fp32 copy anywhere), the
    logprobs are those of the fp32-master policy computing in bf16, and a step trains."""
    from meshrl.policy import Policy
    from meshrl.types import OptimParams

    mixed = Policy.from_options(base_model_dir, backend=backend, dtype="bfloat16")
    pure = Policy.from_options(base_model_dir, backend=backend, dtype="bfloat16", master_dtype="bfloat16")
    assert {q.dtype for q in mixed.model.parameters()} == {torch.float32}
    assert {q.dtype for q in pure.model.parameters()} == {torch.bfloat16}
    # One rank: FSDP only where there is a cast to do (fp32 masters); pure bf16 runs the model as is.
    assert all(isinstance(q, DTensor) for q in mixed.model.parameters())
    assert not any(isinstance(q, DTensor) for q in pure.model.parameters())
    data = random_data(4, seed=5)
    # Same bf16 compute weights (fp32 masters cast to bf16 == weights stored in bf16): same logprobs.
    flat = lambda rows: torch.tensor(sum(rows, []))  # noqa: E731
    torch.testing.assert_close(flat(pure.forward(data)), flat(mixed.forward(data)), rtol=0, atol=0)
    spec = LossSpec("grpo", num_loss_tokens=sum(d.num_loss_tokens for d in data))
    before = {k: v.clone() for k, v in pure.hf_state_dict().items()}
    pure.forward_backward(data, spec)
    assert {q.grad.dtype for q in pure.model.parameters() if q.grad is not None} == {torch.bfloat16}
    assert math.isfinite(pure.optim_step(OptimParams(lr=1e-2)).grad_norm)
    state_dtypes = {t.dtype for st in pure.optimizer.state.values() for k, t in st.items() if k != "step"}
    assert state_dtypes == {torch.bfloat16}
    after = pure.hf_state_dict()
    assert any(not torch.equal(after[k], before[k]) for k in before)
    with pytest.raises(ValueError, match="needs param_dtype='bfloat16'"):
        Policy.from_options(base_model_dir, backend=backend, master_dtype="bfloat16")


@pytest.mark.parametrize("backend", ["hf", "torchtitan"])
def test_packed_rows_equal_unpacked(one_rank_group, base_model_dir, backend):
    """Sequence packing (several examples per row, attention masked across documents, per-document positions)
    changes the compute, not the math: same per-datum loss sum and same gradients as one example per row."""
    from meshrl.controller.training import pad_rows
    from meshrl.data.sft import SFTExample, pack_examples
    from meshrl.policy import Policy
    from meshrl.types import Datum

    examples = [SFTExample(d.tokens[:3], d.tokens[3:]) for d in random_data(8, seed=11)]
    plain = [Datum.from_completion(e.prompt_ids, e.response_ids) for e in examples]
    packed = pad_rows(pack_examples(examples, 24), 1, 0)
    assert len(packed) < len(plain) and any(d.positions.count(0) > 1 for d in packed)
    spec = LossSpec("cross_entropy", num_loss_tokens=sum(d.num_loss_tokens for d in plain))
    out = []
    for data in (plain, packed):
        p = Policy.from_options(base_model_dir, backend=backend)
        loss = p.forward_backward(data, spec).loss
        out.append((loss, {n: full_tensor(q.grad).clone() for n, q in p.model.named_parameters()}))
    assert out[1][0] == pytest.approx(out[0][0], rel=1e-5)
    for name, grad in out[0][1].items():
        torch.testing.assert_close(out[1][1][name], grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_fused_optimizer_skips_a_nonfinite_step_on_the_device(one_rank_group, base_model_dir):
    """The single-GPU path (meshrl.optim.FusedAdamW.clip_and_step: norm, clip, skip and zeroing on the device,
    the step queued before the host reads the norm), run with torch's CPU fused kernel: a non-finite gradient
    leaves weights and optimiser state untouched and discards the gradients."""
    from meshrl.optim import FusedAdamW
    from meshrl.policy import Policy
    from meshrl.types import LossSpec, OptimParams

    p = Policy.from_options(base_model_dir, backend="torchtitan")
    p.optimizer = FusedAdamW([q for q in p.model.parameters() if q.requires_grad], lr=0.0)
    data = random_data(2, seed=5)
    spec = LossSpec("cross_entropy", num_loss_tokens=sum(d.num_loss_tokens for d in data))
    before = {k: v.clone() for k, v in p.model.state_dict().items()}
    for _ in range(2):
        p.forward_backward(data, spec)
        next(q for q in p.model.parameters() if q.grad is not None).grad.view(-1)[0] = float("inf")
        with pytest.raises(FloatingPointError, match="grad norm is inf.*skipped"):
            p.optim_step(OptimParams(lr=1e-2, grad_clip=1.0))
        for k, v in p.model.state_dict().items():
            assert torch.equal(v, before[k]), k
        assert all(float(s["step"]) == 0 for s in p.optimizer.state.values())
        assert all(q.grad is None for q in p.model.parameters())
    p.forward_backward(data, spec)
    result = p.optim_step(OptimParams(lr=1e-2, grad_clip=1.0))
    assert math.isfinite(result.grad_norm) and result.policy_version == 1
    assert all(float(s["step"]) == 1 for s in p.optimizer.state.values())
    assert any(not torch.equal(v, before[k]) for k, v in p.model.state_dict().items())


def test_optim_step_refuses_a_batch_with_a_failed_micro_batch(one_rank_group, base_model_dir):
    """OptimParams.num_micro_batches: a controller that queues optim_step behind its forward_backward calls
    never steps on a partial batch when one of them failed."""
    from meshrl.policy import Policy, collate
    from meshrl.types import LossSpec, OptimParams

    p = Policy.from_options(base_model_dir, backend="torchtitan")
    data = random_data(2, seed=5)
    spec = LossSpec("cross_entropy", num_loss_tokens=2 * sum(d.num_loss_tokens for d in data))
    before = {k: v.clone() for k, v in p.model.state_dict().items()}
    p.forward_backward(data, spec)
    bad = [type(d)(tokens=[10**6] * len(d.tokens), loss_mask=d.loss_mask) for d in data]
    with pytest.raises(ValueError, match="outside"):
        p.forward_backward(bad, spec)
    with pytest.raises(ValueError, match=r"datum 1 has token ids outside \[0, 64\)"):
        collate(data[:1] + bad[:1], 0, torch.device("cpu"), vocab_size=64)
    with pytest.raises(RuntimeError, match="expected 2 successful forward_backward calls.*got 1"):
        p.optim_step(OptimParams(lr=1e-2, num_micro_batches=2))
    assert all(q.grad is None for q in p.model.parameters()) and p.policy_version == 0
    assert all(torch.equal(v, before[k]) for k, v in p.model.state_dict().items())
    for _ in range(2):
        p.forward_backward(data, spec)
    assert p.optim_step(OptimParams(lr=1e-2, num_micro_batches=2)).policy_version == 1
    # The same with the step carried by the last forward_backward: refused before any compute.
    p.forward_backward(data, spec)
    with pytest.raises(ValueError, match="outside"):
        p.forward_backward(bad, spec)
    with pytest.raises(RuntimeError, match="expected 3 successful forward_backward calls.*got 2"):
        p.forward_backward(data, spec, step=OptimParams(lr=1e-2, num_micro_batches=3))
    assert all(q.grad is None for q in p.model.parameters()) and p.policy_version == 1 and p.num_micro_batches == 0
    with pytest.raises(ValueError, match="num_micro_batches=0"):
        OptimParams(lr=1e-2, num_micro_batches=0)


@pytest.mark.parametrize("fused_optimizer", [False, True])
def test_the_step_carried_by_forward_backward_equals_optim_step(one_rank_group, base_model_dir, fused_optimizer):
    """forward_backward(..., step=p) on the last micro-batch == forward_backward + optim_step(p): same weights
    (bitwise), loss, grad norm and version; with torch's foreach AdamW (CPU, FSDP: the step follows the call)
    and with meshrl.optim.FusedAdamW (one GPU: queued behind the backward, here on torch's CPU fused kernel).
    A non-finite loss skips the carried step (weights and optimiser state untouched) and starts the next step
    clean."""
    from meshrl.optim import FusedAdamW
    from meshrl.policy import Policy
    from meshrl.types import OptimParams

    data = random_data(4, seed=6)
    spec = LossSpec("grpo", num_loss_tokens=sum(d.num_loss_tokens for d in data))
    params = OptimParams(lr=1e-2, grad_clip=0.5, weight_decay=0.1, num_micro_batches=2)
    runs = []
    for carried in (False, True):
        p = Policy.from_options(base_model_dir, backend="torchtitan")
        if fused_optimizer:
            p.optimizer = FusedAdamW([q for q in p.model.parameters() if q.requires_grad], lr=0.0)
        out = []
        for _ in range(2):
            first = p.forward_backward(data[:2], spec)
            if carried:
                last = p.forward_backward(data[2:], spec, step=params)
                opt = last.optim
            else:
                last = p.forward_backward(data[2:], spec)
                opt = p.optim_step(params)
            out.append((first.loss + last.loss, opt.grad_norm, opt.policy_version))
        runs.append((out, {k: v.clone() for k, v in p.model.state_dict().items()}, p))
    assert runs[0][0] == runs[1][0]
    for k, v in runs[0][1].items():
        assert torch.equal(runs[1][1][k], v), k
    p = runs[1][2]
    before = {k: v.clone() for k, v in p.model.state_dict().items()}
    steps_before = [float(s["step"]) for s in p.optimizer.state.values()]
    nan = random_data(2, seed=7)
    nan[0].advantage = math.nan
    p.forward_backward(data[:2], spec)
    with pytest.raises(FloatingPointError, match="loss is NaN"):
        p.forward_backward(nan, spec, step=params)
    assert all(torch.equal(v, before[k]) for k, v in p.model.state_dict().items())
    assert [float(s["step"]) for s in p.optimizer.state.values()] == steps_before
    assert p.policy_version == 2 and p.num_micro_batches == 0
    p.forward_backward(data[:2], spec)
    assert p.forward_backward(data[2:], spec, step=params).optim.policy_version == 3
