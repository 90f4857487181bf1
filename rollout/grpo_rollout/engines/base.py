"""The engine interface and its registry, used by the rollout server to generate and to swap weights.

An engine turns prompts (token ids, or texts) into sampled token ids with exact per-token
log-probs, and applies a new weight version, either whole (`load_weights`, safetensors buckets from
HTTP) or streamed bucket by bucket (`begin_update` / `load_bucket` / `finish_update`, the collective
transport, see `grpo_wire.weight_stream`). An engine without the streamed methods gets
`StagedUpdate`, which assembles the version and calls `load_weights` at the end (the whole model in
host memory once).
Who receives a stream is one capability, `StreamReceiver`: an engine whose workers join the
weight groups themselves (vLLM), or else the server's own process.
The server calls it from one worker thread, so an engine never sees a generate and a weight
load at the same time. An engine that can no longer serve at all (vLLM's engine core process died)
raises `EngineDead` from any call, and may say so unasked through `failure()` (`EngineHealth`): the
server then reports `failed` and exits, since only a new process can serve again. Each engine's class
registers in `ENGINES` where it is defined (`@ENGINES.register(name)`); the registry imports this package's
modules at the first lookup, and none of them imports its backend (vLLM, transformers) before an engine
is built, so a server without vLLM installed can still look engines up.
"""

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from grpo_wire.protocol import FinishReason, Routing, Sampling
from grpo_wire.registry import Registry

if TYPE_CHECKING:
    import torch
    from grpo_operator.api.spec import GRPOJobSpec
    from grpo_wire.protocol import WeightStreamRequest

    from grpo_rollout.stream_member import Outcome

# One piece of a streamed bucket: (HF name, first element of the flattened tensor, 1-D values).
BucketPiece = tuple[str, int, "torch.Tensor"]


@dataclass(frozen=True)
class EngineConfig:
    model_path: str  # local directory of an HF-format model and its tokenizer
    dtype: str = "float32"  # bfloat16 | float16 | float32
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    max_batch_size: int = 256  # sequences decoded at once
    tensor_parallel_size: int = 1
    seed: int = 0


@dataclass
class Sample:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    text: str
    routing: Routing | None = None  # set when generate was asked for routing
    # a multi-turn episode (`grpo_rollout.episodes`): 1 per model token, 0 per tool token; None: all model
    mask: list[int] | None = None
    turns: int = 1
    tool_calls: int = 0
    tool_errors: int = 0
    env_reward: float | None = None  # spec.environment: the sum of its step rewards
    env_error: str | None = None  # why the environment failed this episode


@dataclass
class PromptSamples:
    prompt_token_ids: list[int]
    samples: list[Sample]


class Stopped(Exception):
    """Raised inside an engine when the server asked it to stop (draining): the batch is handed back."""


class EngineDead(RuntimeError):
    """The engine cannot serve any more, in this process (its engine core died): permanent. The
    message is the engine's own first error, what an on-call engineer needs to read."""


class EngineHealth(Protocol):
    """An engine that can tell, without a request, that it died (its worker processes are watched)."""

    def failure(self) -> str | None:
        """The engine's first error once it is dead, else None; cheap, called every second."""
        ...


def engine_failure(engine: object) -> str | None:
    """`failure()` of an engine that has one (`EngineHealth`); None for an engine that dies only
    by raising `EngineDead` (the torch engine lives in the server's own process)."""
    check = getattr(engine, "failure", None)
    return check() if callable(check) else None


class Engine(Protocol):
    name: str

    def generate(
        self,
        prompts: Sequence[str | list[int]],
        n: int,
        sampling: Sampling,
        should_stop: Callable[[], bool],
        *,
        routing: bool = False,
    ) -> list[PromptSamples | None]:
        """n samples per prompt, in order; None for prompts left unfinished because should_stop() said so.

        A prompt is token ids (what the server sends, rendered by `grpo_wire.chat`) or a string,
        tokenized as the tokenizer does by default (as vLLM takes TokensPrompt or text).

        routing: also fill each Sample's `routing` (MoE routing replay); ValueError when the engine
        or its model cannot."""
        ...

    def load_weights(self, buckets: Sequence[bytes]) -> int:
        """Apply one complete weight version (safetensors buckets of HF names); return tensors updated.

        Must raise ValueError, before changing anything, for unknown names or mismatched shapes."""
        ...


class StreamedUpdate(Protocol):
    """The bucket-level weight update an engine may implement (the torch engine does; the vLLM
    engine maps it onto vLLM's start/update/finish weight-update phases). The server calls, on
    the engine thread, with no generate in between: `begin_update` once, `load_bucket` per
    received bucket (in any order across senders), `finish_update` once, or `abort_update` when
    the stream broke. Tied embeddings: `lm_head.weight` is not sent when it shares storage with
    the input embedding; an engine whose model ties them must not expect it. An engine whose
    weights can take received bytes as they are may also offer `destination` (`InPlaceUpdate`)."""

    def begin_update(self, tensors: Mapping[str, Sequence[int]]) -> None:
        """Every tensor of the coming version with its full shape; ValueError, before anything
        changes, for unknown names or mismatched shapes."""
        ...

    def load_bucket(self, pieces: Sequence[BucketPiece]) -> None:
        """Apply element ranges of some tensors; each values tensor is only valid during the call."""
        ...

    def finish_update(self) -> int:
        """Make the version whole (post-load processing); ValueError if some element never came.
        Returns the tensors updated."""
        ...

    def abort_update(self) -> None:
        """The stream broke: release what begin_update set up (the model may be half-updated)."""
        ...


class InPlaceUpdate(Protocol):
    """Optional beside `StreamedUpdate`: a large piece is then received straight into the weights
    (no receive buffer, no copy); the others still come through `load_bucket`."""

    def destination(
        self, name: str, start: int, count: int, dtype: "torch.dtype", device: "torch.device"
    ) -> "torch.Tensor | None":
        """Elements [start, start + count) of announced tensor `name`, flattened, as their uint8
        bytes, when the live tensor holds `dtype` on `device` contiguously; else None (the piece
        goes through `load_bucket`). Called between `begin_update` and `finish_update`."""
        ...


class StreamReceiver(Protocol):
    """How a streamed version is received (`grpo_rollout.stream_member`). An engine with this
    capability receives it in its own workers, each a member of every weight group (vLLM: every
    tensor-parallel worker takes the whole bucket on its own device and loads its shard), and
    answers once all of them finished; for any other engine the server's process is the one
    member (`LocalMember`) and applies buckets through `StreamedUpdate`."""

    stream_members: int  # ranks this server takes in every weight group
    # optional `stream_holdings`: per member, the routed experts it keeps (None: all of them), so the
    # trainer sends it those alone (`grpo_wire.holdings`); absent or None: every member the whole model

    def receive_stream(self, request: "WeightStreamRequest", refused: bool) -> "Outcome":
        """Join (for a new epoch), receive and apply `request`'s version at members
        `request.first_member` onwards; `refused`: consume it and drop it (the server refused
        it already). The outcome combines every member's."""
        ...


class StagedUpdate:
    """`StreamedUpdate` for an engine with `load_weights` only: the pieces are assembled into full
    tensors on the host, handed over in one safetensors bucket at the end."""

    def __init__(self, engine: "Engine") -> None:
        self.engine = engine
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._tensors: dict[str, Any] = {}

    def begin_update(self, tensors: Mapping[str, Sequence[int]]) -> None:
        self._shapes = {k: tuple(v) for k, v in tensors.items()}
        self._tensors = {}

    def load_bucket(self, pieces: Sequence[BucketPiece]) -> None:
        import torch

        for name, start, values in pieces:
            if name not in self._shapes:
                raise ValueError(f"piece of {name!r}, which the update did not announce")
            if name not in self._tensors:
                self._tensors[name] = torch.empty(self._shapes[name], dtype=values.dtype)
            self._tensors[name].view(-1)[start : start + values.numel()].copy_(values)

    def finish_update(self) -> int:
        from safetensors.torch import save

        missing = sorted(set(self._shapes) - set(self._tensors))
        if missing:
            raise ValueError(f"{len(missing)} tensor(s) never arrived, e.g. {missing[:3]}")
        tensors, self._tensors = self._tensors, {}
        return self.engine.load_weights([save(tensors)])

    def abort_update(self) -> None:
        self._tensors = {}


def streamed_update(engine: "Engine") -> StreamedUpdate:
    """The engine itself when it streams updates, else a `StagedUpdate` over its `load_weights`."""
    if all(hasattr(engine, m) for m in ("begin_update", "load_bucket", "finish_update", "abort_update")):
        return engine  # type: ignore[return-value]
    return StagedUpdate(engine)


# The engine classes by name: constructed from an EngineConfig, with a `config_for` classmethod.
ENGINES: Registry[Any] = Registry("rollout engine", home="grpo_rollout.engines")


def engine_class(name: str) -> Any:
    """The chosen engine's class; a ValueError naming the choices for an unknown name."""
    return ENGINES.get(name)


def engine_config(name: str, spec: "GRPOJobSpec", **common: Any) -> EngineConfig:
    """The engine's config for a job: `common` (model, dtype, device, batch, TP, seed) and what the
    engine itself reads of the spec (`config_for`, a classmethod every engine has), so adding an
    engine is its module and nothing else of the server's."""
    return engine_class(name).config_for(spec, **common)


def create_engine(name: str, config: EngineConfig) -> Engine:
    """Build the chosen engine (its backend is imported only now, by its constructor)."""
    factory: Callable[[EngineConfig], Engine] = engine_class(name)
    return factory(config)
