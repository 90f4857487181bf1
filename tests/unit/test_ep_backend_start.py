"""What the trainer settles about expert parallelism before reading weights (pure parts).

EP groups bound to the rank's GPU on NCCL (their communicator exists at once: DeepEP v2 reads
it through `_comm_ptr()`, 0 for a lazily created group), `epBackend: deepep` refused at EP 1, and
the one token count per dispatch that `auto`'s measurement and DeepEP's buffers both use.
"""

import pytest
import torch
from grpo_trainer.parallel import check_ep_backend, ep_tokens_per_dispatch, group_device


def test_nccl_groups_are_bound_to_the_ranks_gpu_and_gloo_groups_to_nothing() -> None:
    assert group_device("nccl", 3) == torch.device("cuda", 3)
    assert group_device("gloo", 0) is None


def test_deepep_at_ep_1_is_refused_naming_both_fields() -> None:
    with pytest.raises(ValueError, match=r"epBackend deepep.*expertParallelSize"):
        check_ep_backend("deepep", 1)
    check_ep_backend("deepep", 16)
    check_ep_backend("auto", 1)


def test_tokens_per_dispatch_are_a_micro_batchs() -> None:
    assert ep_tokens_per_dispatch(4, None, 8192) == 32768  # the p5 example: above v2's 16,384 cap
    assert ep_tokens_per_dispatch(4, 12000, 8192) == 12000  # a token budget bounds the micro-batch
