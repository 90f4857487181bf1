"""Which of a vLLM worker's parameters a version wrote (grpo_rollout.engines.vllm_written): judged by
the names the model's `load_weights` returned and by the reload's per-layer element counts, so a
version that misses a parameter (a whole layer, one scale of a layer, one slice of a fused one)
never goes live, and the refusal names it."""

from grpo_rollout.engines.vllm_written import SHOWN, OpenLayer, unwritten
from grpo_rollout.engines.vllm_written import refusal as written_refusal

QKV = "model.layers.0.self_attn.qkv_proj"
EXPECTED = {
    "model.embed_tokens.weight",  # a tied lm_head is this parameter: named_parameters lists it once
    f"{QKV}.weight",
    "model.layers.0.mlp.experts.w13_weight",
    "model.layers.0.mlp.down_proj.weight",
    "model.layers.0.mlp.down_proj.weight_scale_inv",
    "model.norm.weight",
}


def test_a_version_that_wrote_every_parameter_misses_none():
    """Every layer processed while loading (none left open) and every name written; the tied head's
    own module, open with nothing loaded, holds no parameter of its own to miss."""
    head = OpenLayer(loaded=0, total=4096, tensors=frozenset())
    assert unwritten(EXPECTED, set(EXPECTED), {"lm_head": head}) == []


def test_a_parameter_load_weights_never_wrote_is_named():
    assert unwritten(EXPECTED, EXPECTED - {"model.norm.weight"}, {}) == ["model.norm.weight"]


def test_a_layer_that_got_its_weight_but_not_its_fp8_scale_is_refused_by_the_scale():
    """The layer stays open (its elements are not all in): its weight was loaded, its scale never."""
    layer = OpenLayer(loaded=64 * 64, total=64 * 64 + 4, tensors=frozenset({"weight"}))
    open_layers = {"model.layers.0.mlp.down_proj": layer}
    written = None  # a model whose load_weights names nothing: the counts alone still see it
    assert unwritten(EXPECTED, written, open_layers) == ["model.layers.0.mlp.down_proj.weight_scale_inv"]


def test_a_fused_parameter_written_only_in_part_is_named_with_its_count():
    """q and v arrived, k never: the name qkv_proj.weight was written, the layer's elements were not."""
    layer = OpenLayer(loaded=256 + 64, total=256 + 64 + 64, tensors=frozenset({"weight"}))
    got = unwritten(EXPECTED, set(EXPECTED), {QKV: layer})
    assert got == [f"{QKV}.weight (its layer got 320 of 384 elements)"]


def test_a_padded_vocabulary_counts_whole_with_every_tensor_loaded_but_not_without():
    """vLLM pads vocabulary rows with zeros it does not count as loaded: fewer elements is whole there."""
    padded = OpenLayer(loaded=1000 * 32, total=1024 * 32, tensors=frozenset({"weight"}), padded=True)
    assert unwritten(EXPECTED, set(EXPECTED), {"model.embed_tokens": padded}) == []
    empty = OpenLayer(loaded=0, total=1024 * 32, tensors=frozenset(), padded=True)
    assert unwritten(EXPECTED, set(EXPECTED), {"model.embed_tokens": empty}) == ["model.embed_tokens.weight"]


def test_the_refusal_names_the_first_parameters_and_counts_the_rest():
    missing = [f"model.layers.{i}.mlp.experts.w2_weight" for i in range(SHOWN + 3)]
    message = written_refusal(1, missing)
    assert message.startswith(f"vLLM worker 1: {SHOWN + 3} of its parameters not written by this version: ")
    assert "model.layers.0.mlp.experts.w2_weight" in message and "and 3 more" in message
    assert f"model.layers.{SHOWN}.mlp" not in message
