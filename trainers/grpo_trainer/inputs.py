"""The job's model folders and checkpoint folder, checked in the pod's first seconds, before any GPU work.

Called first thing by `grpo_trainer.loop.setup` on every rank (datasets are judged as they are read,
`grpo_trainer.data`; `checkpoint.resumeFrom` by `grpo_trainer.checkpoint.find`). The rules are the
ones `grpo-operator validate --check-paths` applies offline (`grpo_operator.storage.check`); here they
run with the pod's own mounts and credentials, so a path that resolves on a laptop but not in the
cluster still fails the job with the field and the reason in its status (a `ConfigError` with a
trainer-stated reason), not a crash minutes later while loading weights or, for the checkpoint
folder, at the first save, hours in.
"""

from grpo_operator.api.contract import RunContract
from grpo_operator.storage.check import POD_CREDENTIALS, Expect, PathError, check, probe_write

from grpo_trainer.config import ConfigError, RankInfo


def check_inputs(contract: RunContract, info: RankInfo) -> None:
    """Raise ConfigError (field first, reason stated) when a model folder is not a Hugging Face model
    or the checkpoint folder cannot be written (rank 0 writes and deletes one small object)."""
    spec = contract.spec
    fields = [("spec.model.path", spec.model.path)]
    if spec.model.reference_path:
        fields.append(("spec.model.referencePath", spec.model.reference_path))
    try:
        for field, uri in fields:
            check(field, uri, Expect.MODEL, credentials=POD_CREDENTIALS)
        check(
            "spec.checkpoint.path",
            contract.checkpoint_dir,
            Expect.CHECKPOINT_ROOT,
            credentials=POD_CREDENTIALS,
        )
        if info.is_main:
            probe_write("spec.checkpoint.path", contract.checkpoint_dir, credentials=POD_CREDENTIALS)
    except PathError as e:
        raise ConfigError(str(e), reason=e.reason) from None
