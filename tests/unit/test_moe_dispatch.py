"""The dispatch registry and the `local` backend (the reference the distributed backends match)."""

from __future__ import annotations

import pytest
import torch
from grpo_trainer.moe import available_backends, make_dispatcher, register_backend
from grpo_trainer.moe.backends.local import LocalDispatcher
from grpo_trainer.moe.dispatch import BACKENDS, BackendUnavailable, expand_by_local_expert


def test_registry_lists_builtin_backends_and_rejects_unknown_names() -> None:
    names = available_backends()
    # the DeepEP ones are registered where deep_ep is missing too, to say why they cannot serve
    assert {"local", "nccl", "gloo", "auto", "deepep", "deepep_v1", "deepep_v2"} <= set(names)
    with pytest.raises(ValueError, match="unknown EP backend"):
        make_dispatcher("carrier-pigeon", None, 4)


def test_a_registered_backend_is_built_by_name() -> None:
    @register_backend("test-local-twin")
    class Twin(LocalDispatcher):
        name = "test-local-twin"

    try:
        assert isinstance(make_dispatcher("test-local-twin", None, 4), Twin)
        assert isinstance(make_dispatcher("auto", None, 4), LocalDispatcher)
    finally:
        BACKENDS.remove("test-local-twin")


def test_the_deepep_versions_built_by_name_where_deep_ep_is_missing_say_why() -> None:
    for name in ("deepep_v1", "deepep_v2"):
        with pytest.raises(BackendUnavailable, match=f"{name} cannot serve here: deep_ep"):
            make_dispatcher(name, None, 4)


def test_expand_by_local_expert_sorts_valid_slots_by_expert() -> None:
    recv_idx = torch.tensor([[2, -1], [0, 2], [-1, -1], [1, 0]])  # (received token, slot)
    order, counts = expand_by_local_expert(recv_idx, 3)
    assert counts == [2, 1, 2]
    assert (order // 2).tolist() == [1, 3, 3, 0, 1]  # tokens of expert 0, then 1, then 2
    assert recv_idx.reshape(-1)[order].tolist() == [0, 0, 1, 2, 2]


def test_local_dispatch_groups_rows_by_expert_and_combine_sums_per_token() -> None:
    dispatcher = make_dispatcher("local", None, 4)
    x = torch.arange(3.0).repeat_interleave(2).view(3, 2)  # token t has value t
    idx = torch.tensor([[2, 0], [2, 3], [0, 2]])
    weights = torch.tensor([[0.5, 0.5], [0.25, 0.75], [1.0, 2.0]])
    sent = dispatcher.dispatch(x, idx, weights)
    assert sent.counts == [2, 0, 3, 1]
    assert sent.rows[:, 0].tolist() == [0, 2, 0, 1, 2, 1]
    assert sent.weights.tolist() == [0.5, 1.0, 0.5, 0.25, 2.0, 0.75]
    combined = dispatcher.combine(sent.rows * sent.weights[:, None], sent.handle)
    torch.testing.assert_close(combined, x * weights.sum(1, keepdim=True))


def test_alltoall_packs_expert_ids_only_into_dtypes_that_hold_them_exactly() -> None:
    from grpo_trainer.moe.backends.alltoall import pack_dtype

    assert pack_dtype(torch.float32, 4096) == torch.float32
    assert pack_dtype(torch.bfloat16, 128) == torch.bfloat16
    assert pack_dtype(torch.bfloat16, 512) == torch.float32  # bf16 holds integers exactly up to 256
    assert torch.tensor(255.0, dtype=torch.bfloat16).item() == 255.0
    assert torch.tensor(257.0, dtype=torch.bfloat16).item() != 257.0
