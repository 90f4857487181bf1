"""When the vLLM engine may serve after a weight update ends (grpo_rollout.engines.serving_weights):
mixed layers or weights a level-2 sleep released must never serve, a whole version always does."""

from grpo_rollout.engines.serving_weights import ServingWeights


def test_an_update_aborted_before_any_layer_took_keeps_serving_the_old_weights_without_sleep():
    w = ServingWeights()
    w.begin(sleeps=False)
    w.ended_partway(layers_took=False)
    assert w.refusal() is None


def test_an_update_aborted_after_a_layer_took_refuses_until_a_whole_version():
    w = ServingWeights()
    w.begin(sleeps=False)
    w.ended_partway(layers_took=True)
    assert "mixed" in w.refusal()
    w.begin(sleeps=False)
    w.ended_partway(layers_took=False)  # a second broken update does not heal the first
    assert "mixed" in w.refusal()
    w.begin(sleeps=False)
    w.whole()
    assert w.refusal() is None


def test_after_a_level_2_sleep_even_an_update_where_no_layer_took_refuses():
    """The fault: sleep level 2 released every parameter, so the old weights are gone too."""
    w = ServingWeights()
    w.begin(sleeps=True)
    w.ended_partway(layers_took=False)
    assert "sleepForUpdates" in w.refusal()
    w.begin(sleeps=True)
    w.whole()
    assert w.refusal() is None and not w.discarded


def test_a_sleep_in_a_broken_update_is_remembered_by_the_next_broken_one():
    w = ServingWeights()
    w.begin(sleeps=True)
    w.ended_partway(layers_took=False)
    w.begin(sleeps=False)  # whatever the next update does, the released weights are not back
    w.ended_partway(layers_took=False)
    assert "sleepForUpdates" in w.refusal()


def test_the_refusal_says_what_broke_the_update_until_a_whole_version():
    w = ServingWeights()
    w.begin(sleeps=True)
    w.ended_partway(
        layers_took=False, why="vLLM worker 0: 1 of its parameters not written: model.norm.weight"
    )
    assert "model.norm.weight" in w.refusal()
    w.begin(sleeps=True)
    w.whole()
    assert w.refusal() is None and w.why == ""


def test_a_failed_finish_refuses_even_without_sleep_or_a_layer_known_to_have_taken():
    """vLLM's finish writes layers in place: once it raised, what the workers hold is unknown."""
    w = ServingWeights()
    w.begin(sleeps=False)
    w.failed("the weight update failed while finishing it in vLLM: RuntimeError: out of memory")
    assert "out of memory" in w.refusal()
