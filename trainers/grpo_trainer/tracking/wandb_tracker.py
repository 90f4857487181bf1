"""Weights & Biases backend of `tracking.Tracker`: one W&B run per job in the experiment's project.

The API key is W&B's own env (WANDB_API_KEY, from the job's `tracking.credentialsSecret`);
`uri` names a self-hosted server. W&B keeps its local files under WANDB_DIR, by default the
temp folder (a pod's working directory may be read-only); WANDB_MODE=offline writes only those.
"""

import os
import tempfile


class WandbTracker:
    def __init__(self, uri: str | None, experiment: str, run_name: str) -> None:
        import wandb  # the `wandb` extra, only when chosen

        settings = wandb.Settings(base_url=uri) if uri else None
        directory = os.environ.get("WANDB_DIR", tempfile.gettempdir())
        self._run = wandb.init(project=experiment, name=run_name, dir=directory, settings=settings)

    @property
    def run_dir(self) -> str:
        """The run's local folder (what offline mode syncs later)."""
        return os.path.dirname(self._run.dir)

    def log_params(self, params: dict[str, str]) -> None:
        self._run.config.update(params, allow_val_change=True)

    def log_metrics(self, values: dict[str, float], step: int) -> None:
        self._run.log(values, step=step)

    def close(self) -> None:
        self._run.finish()
