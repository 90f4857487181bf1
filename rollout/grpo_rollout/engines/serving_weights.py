"""Whether a vLLM engine's weights may serve, across weight updates (pure; `vllm_engine` keeps one).

vLLM cannot undo a reload that some layers already took, and `sleepForUpdates` sleeps at level 2,
which keeps only the model's buffers: `gpu_worker.sleep(level=2)` (vllm 0.32.0,
v1/worker/gpu_worker.py:294-311) saves buffers and suspends the rest, and `wake_up(["weights"])`
hands the parameters back as memory with no values in it. So an update that ends before the whole
version is in leaves weights that must not serve: mixed (some layers new), or, after a level-2
sleep, garbage even if no layer took anything.
"""

from dataclasses import dataclass


@dataclass
class ServingWeights:
    """`torn`: an update ended part-way; generation is refused until a whole version loads.
    `discarded`: a level-2 sleep dropped the parameters since the last whole version.
    `why`: what ended the last broken update (said with the refusal)."""

    torn: bool = False
    discarded: bool = False
    why: str = ""

    def begin(self, *, sleeps: bool) -> None:
        """An update starts; `sleeps`: the engine sleeps at level 2 for it (the weights go)."""
        self.discarded = self.discarded or sleeps

    def whole(self) -> None:
        """A whole version is in every worker: it serves."""
        self.torn = self.discarded = False
        self.why = ""

    def ended_partway(self, layers_took: bool, why: str = "") -> None:
        """The update ended before the whole version was in (aborted, or its stream broke)."""
        self.torn = self.torn or layers_took or self.discarded
        if self.torn and why:
            self.why = why

    def failed(self, why: str) -> None:
        """The update failed where what the workers hold is not known (their finish raised part-way
        through vLLM's in-place writes) or vLLM would not wake up: refused until a whole version."""
        self.torn, self.why = True, why

    def refusal(self) -> str | None:
        """Why generation is refused now, or None."""
        if not self.torn:
            return None
        because = f" ({self.why})" if self.why else ""
        if self.discarded:
            return (
                "the vllm engine's weights were released for a weight update (rollout.vllm.sleepForUpdates: "
                f"vLLM sleep level 2) and that update broke before the whole version was in{because}: it "
                "generates again once the next whole version is loaded"
            )
        return (
            "the vllm engine's weights are mixed (a weight update broke after some layers took new "
            f"weights){because}: it generates again once the next whole version is loaded"
        )
