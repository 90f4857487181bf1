"""`auto`'s candidate filtering by layout (pure): node span, device, installed DeepEP versions."""

from __future__ import annotations

import pytest
from grpo_trainer.moe import autoselect
from grpo_trainer.moe.autoselect import EPShape, Layout
from grpo_trainer.moe.backends import deepep_v1, deepep_v2


class FakeV1:
    """The v1 `Buffer` class surface `requires` probes: a config map like v1.2.1's."""

    sizes = (2, 4, 8, 16, 24, 32, 64, 128, 144, 160)

    @classmethod
    def get_dispatch_config(cls, num_ranks: int) -> object:
        if num_ranks not in cls.sizes:
            raise KeyError(num_ranks)  # v1.2.1: `config_map[num_ranks]`
        return object()

    get_combine_config = get_dispatch_config


def layout(first: int, size: int, per_node: int = 8, device: str = "cuda") -> Layout:
    return Layout(tuple(range(first, first + size)), per_node, device)


@pytest.mark.parametrize(
    ("ranks", "per_node", "nodes"),
    [((0, 1, 2, 3), 8, 1), (tuple(range(8, 16)), 8, 1), (tuple(range(16)), 8, 2), ((6, 7, 8, 9), 8, 2)],
)
def test_layout_counts_the_nodes_an_ep_group_spans(ranks: tuple[int, ...], per_node: int, nodes: int) -> None:
    lay = Layout(ranks, per_node, "cuda")
    assert lay.nodes == nodes and lay.spans_nodes == (nodes > 1) and lay.size == len(ranks)


def test_the_all_to_all_of_the_groups_device_is_always_a_candidate_and_first() -> None:
    names, refused = autoselect.candidates(layout(0, 4, device="cpu"), 8)
    assert names[0] == "gloo" and "gloo" not in refused and "nccl" not in names
    assert "on cpu" in refused["nccl"]
    names, refused = autoselect.candidates(layout(0, 4, device="cuda"), 8)
    assert names[0] == "nccl" and "on cuda" in refused["gloo"]
    names, refused = autoselect.candidates(layout(0, 3, device="cpu"), 8)
    assert "gloo" not in names and "do not divide" in refused["gloo"]


def test_v1_serves_groups_inside_one_node_only() -> None:
    assert deepep_v1.requires(layout(0, 8), 64, FakeV1) is None
    assert deepep_v1.requires(layout(8, 4), 64, FakeV1) is None  # second node's own group
    why = deepep_v1.requires(layout(0, 16), 64, FakeV1)  # EP 16 over two p5 nodes
    assert why is not None and "IBGDA" in why and "2 nodes" in why
    assert "CUDA" in deepep_v1.requires(layout(0, 2, device="cpu"), 8, FakeV1)


def test_v1_sizes_come_from_the_installed_library() -> None:
    why = deepep_v1.requires(layout(0, 6, per_node=6), 12, FakeV1)
    assert why is not None and "no config for EP 6" in why
    FakeV1.sizes = (*FakeV1.sizes, 6)  # a later version that knows 6
    try:
        assert deepep_v1.requires(layout(0, 6, per_node=6), 12, FakeV1) is None
    finally:
        FakeV1.sizes = FakeV1.sizes[:-1]


def test_v2_serves_groups_that_span_nodes() -> None:
    fake = object()
    assert deepep_v2.requires(layout(0, 16), 128, fake) is None
    assert "inside one node" in deepep_v2.requires(layout(0, 8), 128, fake)
    assert "at most 256" in deepep_v2.requires(layout(0, 16), 16 * 257, fake)
    assert "CUDA" in deepep_v2.requires(layout(0, 16, device="cpu"), 128, fake)


def test_missing_versions_are_refused_with_the_import_error() -> None:
    for version, lay in ((deepep_v1, layout(0, 8)), (deepep_v2, layout(0, 16))):
        if not version.AVAILABLE:
            assert version.requires(lay, 64) == version.WHY and "deep_ep" in version.WHY


def test_v2_settings_on_efa_pass_sms_explicitly() -> None:
    assert deepep_v2.settings({"FI_PROVIDER": "efa"}) == (16384, 12, 2)  # QPs: upstream's EFA cap
    assert deepep_v2.settings({}) == (16384, None, None)
    env = {"FI_PROVIDER": "efa", "GRPO_DEEPEP_NUM_SMS": "24", "GRPO_DEEPEP_NUM_QPS": "33"}
    env["GRPO_DEEPEP_MAX_TOKENS"] = "4096"
    assert deepep_v2.settings(env) == (4096, 24, 33)


def test_ep_shape_rejects_empty_sizes() -> None:
    with pytest.raises(ValueError, match="positive"):
        EPShape(hidden=0)


def test_selection_summary_lists_times_and_failures() -> None:
    failed = {"deepep_v2": "rank 3: RuntimeError: no GIN"}
    skipped = {"deepep_v1": "rank 0: the EP group spans 2 nodes"}
    sel = autoselect.Selection("nccl", {"nccl": 0.0012}, skipped, failed)
    assert sel.summary() == {
        "nccl": "1.200 ms",
        "deepep_v1": "skipped: rank 0: the EP group spans 2 nodes",
        "deepep_v2": "failed: rank 3: RuntimeError: no GIN",
    }
