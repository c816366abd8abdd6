"""torchtitan imported with its import-time torch.compile calls deferred (meshrl.models.titan_import): the deferred
wrappers are made once, with the options given at import, and the flex / compiled paths get torch.compile's own."""

from meshrl.models.titan_import import DeferredCompile, compile_deferred_kernels, import_torchtitan_qwen3


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


def test_the_flex_kernels_are_torch_compile_wrappers_of_torchtitans_functions_once_made():
    import_torchtitan_qwen3()
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from torchtitan.models.common import attention

    compile_deferred_kernels()  # what a flex-attention or compiled trainer does before it builds its model
    made = (attention.FlexAttention._compiled_flex_attn, attention._compiled_create_block_mask)
    assert [fn._torchdynamo_orig_callable for fn in made] == [flex_attention, create_block_mask]
