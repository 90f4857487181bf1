"""MLflow backend of `tracking.Tracker`: one run per job on an MLflow tracking server.

Credentials are MLflow's own env (MLFLOW_TRACKING_TOKEN, or MLFLOW_TRACKING_USERNAME and
MLFLOW_TRACKING_PASSWORD), set from the job's `tracking.credentialsSecret` by the renderer.
"""

import time

BATCH = 100  # MLflow's log_batch takes at most 100 params per call


class MlflowTracker:
    def __init__(self, uri: str | None, experiment: str, run_name: str) -> None:
        from mlflow import MlflowClient  # the `mlflow` extra, only when chosen

        self._client = MlflowClient(tracking_uri=uri)
        found = self._client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else self._client.create_experiment(experiment)
        self.run_id = self._client.create_run(experiment_id, run_name=run_name).info.run_id

    def log_params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in sorted(params.items())]
        for i in range(0, len(items), BATCH):
            self._client.log_batch(self.run_id, params=items[i : i + BATCH])

    def log_metrics(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(k, v, now, step) for k, v in sorted(values.items())]
        self._client.log_batch(self.run_id, metrics=items)

    def close(self) -> None:
        self._client.set_terminated(self.run_id)
