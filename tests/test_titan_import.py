"""torchtitan imported with its import-time torch.compile calls deferred (meshrl.models.titan_import): the deferred
wrappers are made once, with the options given at import, and the flex / compiled paths get torch.compile's own."""

import torch

from meshrl.models.titan_import import DeferredCompile, compile_deferred_kernels, deferring, import_torchtitan_qwen3


def test_a_deferred_compile_is_made_once_on_first_call_with_the_options_it_was_given():
    made = []

    def fake_compile(fn, **kwargs):
        made.append(kwargs)
        return lambda *a, **k: ("compiled", fn(*a, **k))

    options = {"max_autotune": True}
    deferred = DeferredCompile(fake_compile, lambda x, y=1: x + y, {"options": options})
    options["max_autotune"] = False  # as torch.compile does, the options are read when it is called
    assert made == []
    assert deferred(2, y=3) == ("compiled", 5) and deferred(1) == ("compiled", 2)
    assert made == [{"options": {"max_autotune": True}}]


def test_plain_functions_are_deferred_unless_dynamo_is_disabled(monkeypatch):
    made = []

    def fake_compile(model=None, **kwargs):
        made.append(model)
        return "compiled"

    compile = deferring(fake_compile)
    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)
    deferred = compile(len, options={}), compile(abs)  # builtins are not plain functions: compiled at once
    assert deferred == ("compiled", "compiled") and made == [len, abs]
    assert isinstance(compile(_double), DeferredCompile) and made == [len, abs]
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")  # torch.compile then answers at once, without inductor
    assert compile(_double) == "compiled" and made == [len, abs, _double]


def _double(x):
    return 2 * x


def test_made_kernels_are_torch_compiles_own(monkeypatch):
    import_torchtitan_qwen3()  # first: the plain import below would not defer anything
    from torch.nn.attention.flex_attention import create_block_mask
    from torchtitan.models.common import attention

    compile_deferred_kernels()  # what a flex-attention or compiled trainer does before it builds its model
    assert not isinstance(attention.FlexAttention._compiled_flex_attn, DeferredCompile)
    assert not isinstance(attention._compiled_create_block_mask, DeferredCompile)
    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)  # set by an in-process vLLM engine of this worker
    made = DeferredCompile(torch.compile, create_block_mask, {}).materialize()
    assert made is not create_block_mask and made.__wrapped__ is create_block_mask
