"""TensorBoard backend of `tracking.Tracker`: event files under `<uri>/<experiment>/<job>`.

Written with torch's SummaryWriter (it needs the `tensorboard` package, the extra of that name);
the parameters go in as one text summary, a table of name and value. A restarted gang appends
a new event file to the same folder, which TensorBoard reads as one run.
"""

import os


class TensorBoardTracker:
    def __init__(self, uri: str | None, experiment: str, run_name: str) -> None:
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only when chosen

        if not uri:
            raise ValueError("tracking.uri: tensorboard needs the event files' directory")
        self.log_dir = os.path.join(uri, experiment, run_name)
        self._writer = SummaryWriter(log_dir=self.log_dir)

    def log_params(self, params: dict[str, str]) -> None:
        rows = "\n".join(f"| {k} | {v} |" for k, v in sorted(params.items()))
        self._writer.add_text("params", f"| name | value |\n| --- | --- |\n{rows}", global_step=0)

    def log_metrics(self, values: dict[str, float], step: int) -> None:
        for name, value in sorted(values.items()):
            self._writer.add_scalar(name, value, global_step=step)
        self._writer.flush()  # a TensorBoard reading the folder sees each step as it lands

    def close(self) -> None:
        self._writer.close()
