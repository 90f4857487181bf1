"""Wire protocol of the rollout servers: the only shapes that cross the trainer/rollout boundary.

The rollout server (`grpo_rollout.server`) parses requests with these models and answers with
them; the trainer imports this module (and `grpo_wire.client`) and nothing else of the rollout
package. Every payload carries `protocol_version`, so a trainer and a server built from different
releases fail with a clear message instead of misreading each other. Models import only pydantic.

Endpoints (all JSON except the weight body):
  POST /generate  GenerateRequest -> GenerateResponse        (bearer token)
  POST /weights   one safetensors bucket, WeightBucket headers -> WeightUpdateResponse (bearer token)
  POST /weights/stream  WeightStreamRequest -> WeightUpdateResponse, the version itself arriving over
                  a torch.distributed group (`grpo_wire.weight_stream`; bearer token)
  GET  /health    -> HealthResponse (200 ready, 503 loading/draining/failed; no token, for probes)
A reward model server (spec.reward.model, `grpo_rollout.reward_model`) answers, to the rollout servers:
  POST /score     ScoreRequest -> ScoreResponse (bearer token)
  GET  /health    -> HealthResponse (engine "reward-classifier" / "reward-generative")
  GET  /metrics   Prometheus text (no token)
Every error is an ErrorResponse with a machine-readable `code`. One of them is permanent for the
server that sends it: `engine_dead` (HTTP 500, health state `failed`): its engine cannot serve any
more, it exits at once and only a new process (a restarted pod) serves again; a client re-sends
elsewhere and never to that process. Every other 5xx/409/429 means "not now, maybe later".
Two are about the job's reward model (spec.reward.model), answered by /score and passed on by
/generate: `reward_misconfigured` (HTTP 422, permanent for the job: the model cannot score as
configured, e.g. a judge prompt naming a column the rows lack, a classifier with more than one output;
the message names the spec field) and `reward_unavailable` (HTTP 502 from /generate: no reward model
server scored the completions within 3 x spec.reward.model.timeoutSeconds; a retry may succeed once a
replacement is up).
"""

import base64
import binascii
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from grpo_wire.holdings import Holding

PROTOCOL_VERSION = 3  # 3: members receive what they hold (WeightStreamRequest.classes, holdings)

# Bounds a server enforces (413 for bodies, 422 for counts) and a client respects when it splits work.
MAX_PROMPTS_PER_REQUEST = 1024
MAX_SEQUENCES_PER_REQUEST = 16384  # prompts * n
MAX_GROUP_SIZE = 1024
MAX_CHAT_MESSAGES = 256
MAX_SCORE_ITEMS = 1024  # completions per /score request (reward.model.batchSize at most)
MAX_PROMPT_CHARS = 65536
MAX_NEW_TOKENS = 131072
MAX_GENERATE_BODY_BYTES = 16 * 1024 * 1024
MAX_WEIGHT_BUCKET_BYTES = 2 * 1024 * 1024 * 1024
MAX_WEIGHT_BUCKETS = 4096
DEFAULT_WEIGHT_BUCKET_BYTES = 256 * 1024 * 1024

AUTH_HEADER = "Authorization"
WEIGHTS_CONTENT_TYPE = "application/vnd.safetensors"

FinishReason = Literal["stop", "length"]
RoutingDtype = Literal["uint8", "int16"]
ROUTING_ITEMSIZE: dict[str, int] = {"uint8": 1, "int16": 2}
ServerState = Literal["loading", "ready", "draining", "failed"]


class WireModel(BaseModel):
    """Base of every payload: snake_case on the wire, unknown fields rejected so typos fail loudly."""

    model_config = ConfigDict(extra="forbid")


class Versioned(WireModel):
    protocol_version: Literal[3] = Field(
        default=PROTOCOL_VERSION, description="protocol_version: must equal the server's PROTOCOL_VERSION."
    )


class Sampling(WireModel):
    """How completions are drawn; mirrors the GRPOJob's algorithm fields of the same names."""

    temperature: float = Field(
        default=1.0,
        ge=0,
        le=10,
        description="temperature: logits are divided by it; 0 is greedy decoding (the most likely token, "
        "top_p and seed unused; its logprobs are those of log_softmax(logits)), what evaluations use.",
    )
    top_p: float = Field(default=1.0, gt=0, le=1, description="top_p: nucleus mass kept, (0, 1].")
    max_new_tokens: int = Field(
        default=256, ge=1, le=MAX_NEW_TOKENS, description="max_new_tokens: length cap."
    )
    seed: int | None = Field(
        default=None,
        ge=0,
        description="seed: optional. The same request (prompts, n, seed) to a server with the same weights "
        "and batch size gives the same samples.",
    )


class ChatMessage(BaseModel):
    """One chat turn as chat templates read it (OpenAI-style); other keys a template may read
    (tool_calls, tool_call_id, name, reasoning_content) pass through."""

    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = Field(default=None, max_length=MAX_PROMPT_CHARS)


class Prompt(WireModel):
    id: str = Field(min_length=1, max_length=256, description="id: caller's key; echoed back as prompt_id.")
    text: str | None = Field(
        default=None,
        max_length=MAX_PROMPT_CHARS,
        description="text: one of text/messages. The prompt as a string: under the job's chat template "
        "(spec.dataset.chatTemplate auto, the model having one) one user turn, else tokenized as is.",
    )
    messages: list[ChatMessage] | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_CHAT_MESSAGES,
        description="messages: one of text/messages. The prompt as chat messages, put through the "
        "model's chat template with the generation prompt added (`grpo_wire.chat`).",
    )
    columns: dict[str, Any] = Field(
        default_factory=dict,
        description="columns: the dataset row's other columns (e.g. answer), passed to reward functions.",
    )

    @model_validator(mode="after")
    def _one_form(self) -> "Prompt":
        if (self.text is None) == (self.messages is None):
            raise ValueError("exactly one of text and messages must be set")
        return self

    @classmethod
    def of(cls, id: str, prompt: str | list[dict[str, Any]], columns: dict[str, Any]) -> "Prompt":
        """A dataset row's prompt, a string or a list of chat messages, as the wire carries it."""
        if isinstance(prompt, str):
            return cls(id=id, text=prompt, columns=columns)
        return cls(id=id, messages=[ChatMessage.model_validate(m) for m in prompt], columns=columns)

    @property
    def raw(self) -> str | list[dict[str, Any]]:
        """The prompt as the dataset had it: what reward functions receive as `prompts` (TRL's
        convention: a string, or the list of message dicts of a conversational row)."""
        if self.messages is None:
            assert self.text is not None
            return self.text
        return [m.model_dump(exclude_none=True) for m in self.messages]


class GenerateRequest(Versioned):
    request_id: str = Field(min_length=1, max_length=256, description="request_id: echoed back, for logs.")
    prompts: list[Prompt] = Field(min_length=1, max_length=MAX_PROMPTS_PER_REQUEST)
    n: int = Field(ge=1, le=MAX_GROUP_SIZE, description="n: completions per prompt (the GRPO group size).")
    sampling: Sampling = Field(default_factory=Sampling)
    min_weight_version: int | None = Field(
        default=None,
        ge=0,
        description="min_weight_version: optional. A server with older weights answers 409 weight_too_old.",
    )
    return_routing: bool = Field(
        default=False,
        description="return_routing: optional, default false. Each completion carries `routing` (MoE "
        "routing replay); a server whose engine or model cannot record it answers 422.",
    )

    @model_validator(mode="after")
    def _bounded(self) -> "GenerateRequest":
        total = len(self.prompts) * self.n
        if total > MAX_SEQUENCES_PER_REQUEST:
            raise ValueError(
                f"prompts * n = {total} exceeds {MAX_SEQUENCES_PER_REQUEST} sequences per request"
            )
        ids = [p.id for p in self.prompts]
        if len(set(ids)) != len(ids):
            raise ValueError("prompt ids must be unique within a request")
        return self


class RewardDetail(WireModel):
    """One reward function's share of a completion's reward; `error` says why it scored 0."""

    name: str = Field(description="name: builtin name or 'module:function'.")
    weight: float
    score: float = Field(description="score: unweighted value (0 when error is set).")
    error: str | None = Field(default=None, description="error: why this function failed for this sample.")
    timed_out: bool = Field(
        default=False,
        description="timed_out: the judgement ran out of its time (a reward's own budget, or "
        "reward.timeoutSeconds), so score 0 is no verdict; counted as reward_timeouts, never silently.",
    )


class Routing(WireModel):
    """The top-k expert ids each MoE layer chose for each token fed through the model, compactly.

    Rows are the prompt tokens then the completion tokens except the last one (the last sampled
    token is never fed back, so no layer routed it): [len(prompt) + len(completion) - 1, layers, k].
    Base64 of a C-order little-endian array keeps it at tokens x layers x k bytes (uint8, up to
    256 experts) or twice that (int16); a JSON list of ints would be 3-4 times larger.
    """

    shape: tuple[int, int, int] = Field(description="shape: [tokens, MoE layers, k].")
    dtype: RoutingDtype = Field(description="dtype: uint8 (<= 256 experts) or int16, little-endian.")
    data: str = Field(description="data: base64 of the array's bytes.")

    @model_validator(mode="after")
    def _sized(self) -> "Routing":
        tokens, layers, k = self.shape
        if tokens < 0 or layers < 1 or k < 1:
            raise ValueError(f"routing shape {list(self.shape)} needs tokens >= 0, layers >= 1, k >= 1")
        size = len(self.raw())
        want = tokens * layers * k * ROUTING_ITEMSIZE[self.dtype]
        if size != want:
            raise ValueError(
                f"routing data has {size} bytes, shape {list(self.shape)} of {self.dtype} needs {want}"
            )
        return self

    def raw(self) -> bytes:
        """The array's bytes (C order, little-endian); ValueError when `data` is not base64."""
        try:
            return base64.b64decode(self.data, validate=True)
        except binascii.Error as e:
            raise ValueError(f"routing data is not base64: {e}") from None

    @classmethod
    def from_bytes(cls, raw: bytes, shape: tuple[int, int, int], dtype: RoutingDtype) -> "Routing":
        return cls(shape=shape, dtype=dtype, data=base64.b64encode(raw).decode("ascii"))


class Completion(WireModel):
    text: str = Field(description="text: decoded completion, special tokens skipped.")
    token_ids: list[int] = Field(
        description="token_ids: sampled tokens, including the EOS token if one ended it."
    )
    logprobs: list[float] = Field(
        description="logprobs: per token of token_ids, log-prob under the sampling policy: "
        "log_softmax(logits / temperature) restricted to the top_p nucleus and renormalised "
        "(with top_p = 1 that is plain log_softmax(logits / temperature))."
    )
    finish_reason: FinishReason = Field(
        description="finish_reason: stop (EOS, or a multi-turn episode its environment or the model ended) "
        "or length (the max_new_tokens budget ended it: a turn cut there, or a tool's or environment's "
        "reply that did not fit)."
    )
    reward: float = Field(description="reward: weighted sum of the reward functions' scores.")
    reward_details: list[RewardDetail] = Field(default_factory=list)
    routing: Routing | None = Field(
        default=None, description="routing: set when the request had return_routing (see Routing)."
    )
    mask: list[int] | None = Field(
        default=None,
        description="mask: per token of token_ids, 1 where the model sampled it and 0 where a tool wrote "
        "it (a multi-turn episode: its logprob is 0 and the trainer leaves it out of the loss); None: "
        "every token is the model's.",
    )
    turns: int = Field(
        default=1,
        ge=0,
        description="turns: the model's turns in this episode (0: its environment failed to open it).",
    )
    tool_calls: int = Field(default=0, ge=0, description="tool_calls: tools called during the episode.")
    tool_errors: int = Field(
        default=0, ge=0, description="tool_errors: calls that failed (raised, timed out, malformed)."
    )

    @model_validator(mode="after")
    def _aligned(self) -> "Completion":
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(f"{len(self.token_ids)} token_ids but {len(self.logprobs)} logprobs")
        if self.mask is not None and len(self.mask) != len(self.token_ids):
            raise ValueError(f"{len(self.token_ids)} token_ids but {len(self.mask)} mask entries")
        return self


class PromptResult(WireModel):
    prompt_id: str
    prompt_token_ids: list[int] = Field(
        description="prompt_token_ids: the prompt as the server tokenized it."
    )
    completions: list[Completion] = Field(description="completions: exactly n of them.")
    weight_version: int | None = Field(
        default=None,
        ge=0,
        description="weight_version: the weights these were sampled with (servers always set it).",
    )

    @model_validator(mode="after")
    def _routing_covers_each_sequence(self) -> "PromptResult":
        for i, c in enumerate(self.completions):
            want = len(self.prompt_token_ids) + len(c.token_ids) - 1
            if c.routing is not None and c.routing.shape[0] != want:
                raise ValueError(
                    f"completion {i}: routing has {c.routing.shape[0]} rows, prompt + completion - 1 = {want}"
                )
        return self


class GenerateResponse(Versioned):
    request_id: str
    server_id: str = Field(description="server_id: which server answered (pod name or host:port).")
    weight_version: int = Field(
        ge=0, description="weight_version: the weights every completion was sampled with."
    )
    results: list[PromptResult] = Field(description="results: in request order, minus unfinished prompts.")
    unfinished_prompt_ids: list[str] = Field(
        default_factory=list,
        description="unfinished_prompt_ids: prompts handed back (server draining); re-send them elsewhere.",
    )
    generation_seconds: float = Field(default=0.0, ge=0)
    reward_seconds: float = Field(default=0.0, ge=0)


class WeightBucket(Versioned):
    """Describes one bucket of a weight version; travels as HTTP headers next to a safetensors body.

    A version is split into `count` buckets, each a safetensors file of tensors named as in the
    transformers model's `state_dict()` (in-memory names: transformers >= 5 fuses MoE experts into
    `mlp.experts.gate_up_proj`/`down_proj`; engines that need checkpoint names convert), any subset of
    the model's parameters. The server stages them and swaps all of them in at once when
    the last one arrives, so a generate never sees a half-updated model. Re-sending a bucket is
    harmless; a bucket of a newer version discards an unfinished older one.
    """

    version: int = Field(ge=1, description="version: the new weight version (must exceed the live one).")
    index: int = Field(ge=0, description="index: this bucket's position, 0 <= index < count.")
    count: int = Field(ge=1, le=MAX_WEIGHT_BUCKETS, description="count: buckets in this version.")

    @model_validator(mode="after")
    def _index_in_range(self) -> "WeightBucket":
        if self.index >= self.count:
            raise ValueError(f"bucket index {self.index} out of range for {self.count} buckets")
        return self

    HEADERS: ClassVar[dict[str, str]] = {
        "protocol_version": "X-Grpo-Protocol-Version",
        "version": "X-Grpo-Weight-Version",
        "index": "X-Grpo-Bucket-Index",
        "count": "X-Grpo-Bucket-Count",
    }

    def to_headers(self) -> dict[str, str]:
        return {header: str(getattr(self, field)) for field, header in self.HEADERS.items()}

    @classmethod
    def from_headers(cls, headers: Any) -> "WeightBucket":
        """Parse from a case-insensitive header mapping; missing headers fail validation by name."""
        values = {field: headers.get(header) for field, header in cls.HEADERS.items()}
        return cls.model_validate({k: _header_int(v) for k, v in values.items() if v is not None})


def _header_int(value: str) -> int | str:
    """Header values are text; integers are converted so int fields validate (bad text still fails)."""
    try:
        return int(value)
    except ValueError:
        return value


class WeightStreamRequest(Versioned):
    """Join the trainer's weight groups (when `epoch` is new) and receive `version` over them.

    The trainer hosts a TCPStore at `store_host:store_port`. Receiving members are numbered over
    all servers; this server's (`HealthResponse.stream_members` of them: its process, or each worker
    of its engine) are `first_member` onwards. Member m is in one group: with trainer rank
    m mod `feeders`, which forwards it the whole version, and the other members that rank feeds
    (`grpo_wire.holdings.lanes`). Member m holds `holdings[classes[m]]` of the `expert_tensors`
    (null: all) and receives only that; without `classes` every member holds the whole model.
    `tensors` names every tensor of the version with
    its full shape: the server checks them before anything changes and makes the version live only
    when every element of each one arrived at every member."""

    version: int = Field(ge=1, description="version: the new weight version.")
    epoch: int = Field(
        ge=0, description="epoch: the group generation; a new one means form the groups again."
    )
    store_host: str = Field(min_length=1, max_length=253)
    store_port: int = Field(ge=1, le=65535)
    backend: Literal["gloo", "nccl"]
    feeders: int = Field(
        ge=1, le=65536, description="feeders: trainer ranks forwarding the version, one group each."
    )
    members: int = Field(
        ge=1, le=65536, description="members: receiving members in every group, all servers together."
    )
    first_member: int = Field(ge=0, description="first_member: this server's first member among them.")
    timeout_s: float = Field(default=300.0, gt=0, le=3600)
    tensors: dict[str, list[int]] = Field(description="tensors: HF name -> full shape, every tensor sent.")
    classes: list[int] = Field(
        default_factory=list,
        description="classes: every member's holding class (empty: one class, the whole model).",
    )
    holdings: list[list[int] | None] = Field(
        default_factory=list,
        description="holdings: per class, the routed experts its members hold (null: all).",
    )
    expert_tensors: list[str] = Field(
        default_factory=list,
        description="expert_tensors: the tensors whose dim 0 is the routed expert.",
    )

    def holding(self, member: int) -> Holding:
        """What member `member` holds (0-based among all members)."""
        if not self.classes:
            return Holding()
        experts = self.holdings[self.classes[member]]
        return Holding(None if experts is None else tuple(experts))

    @model_validator(mode="after")
    def _member_in_range(self) -> "WeightStreamRequest":
        if self.first_member >= self.members:
            raise ValueError(f"first_member {self.first_member} out of range for {self.members} members")
        if self.classes and (
            len(self.classes) != self.members or sorted(set(self.classes)) != list(range(len(self.holdings)))
        ):
            raise ValueError(
                f"classes must give each of the {self.members} members one of the {len(self.holdings)} "
                "holdings' classes, each used"
            )
        return self


class WeightUpdateResponse(Versioned):
    server_id: str
    live_version: int = Field(ge=0, description="live_version: the weights generate uses now.")
    staged_version: int | None = Field(default=None, description="staged_version: version being assembled.")
    buckets_received: int = Field(default=0, ge=0, description="buckets_received: of staged_version.")
    applied: bool = Field(description="applied: this bucket completed its version and it is live now.")
    parameters_updated: int = Field(default=0, ge=0, description="parameters_updated: tensors swapped in.")


class HealthResponse(Versioned):
    server_id: str
    state: ServerState
    weight_version: int = Field(ge=0)
    engine: str
    model: str
    in_flight: int = Field(ge=0, description="in_flight: generate requests being served or queued.")
    stream_members: int = Field(
        default=1,
        ge=1,
        le=4096,
        description="stream_members: receiving members of this server in weight streams (its process for "
        "the torch engine, each tensor-parallel worker for vLLM).",
    )
    stream_holdings: list[list[int] | None] | None = Field(
        default=None,
        description="stream_holdings: per member, the routed experts it holds (null: the whole model); "
        "null for all: every member holds the whole model.",
    )
    error: str | None = Field(
        default=None,
        max_length=4000,
        description="error: set when state is failed: the engine's own first error (the server exits).",
    )


ErrorCode = Literal[
    "unauthorized",
    "bad_request",
    "too_large",
    "protocol_mismatch",
    "draining",
    "loading",
    "weight_too_old",
    "weight_version_conflict",
    "weight_version_refused",
    "weight_stream_cancelled",
    "engine_dead",
    "reward_misconfigured",
    "reward_unavailable",
    "internal",
]
ENGINE_DEAD: ErrorCode = "engine_dead"  # permanent for the server process that answers it
REWARD_MISCONFIGURED: ErrorCode = "reward_misconfigured"  # permanent for the job (HTTP 422)
REWARD_UNAVAILABLE: ErrorCode = "reward_unavailable"  # no reward model server answered in time (HTTP 502)


class ScoreItem(WireModel):
    """One completion to score, with its prompt and its row's columns (what a judge's prompt names)."""

    prompt: str | list[ChatMessage] = Field(description="prompt: the text, or the chat, that was answered.")
    completion: str = Field(description="completion: the model's answer, decoded.")
    columns: dict[str, Any] = Field(default_factory=dict, description="columns: the row's reward columns.")


class ScoreRequest(Versioned):
    request_id: str = Field(min_length=1, max_length=128)
    items: list[ScoreItem] = Field(min_length=1, max_length=MAX_SCORE_ITEMS)


class ScoreResponse(Versioned):
    """One score per item, in order; an item that could not be scored (a judge's text without a
    score) has score 0.0 and its `errors` entry says why."""

    scores: list[float]
    errors: list[str | None]
    model: str = Field(description="model: the reward model's path, for the details.")


class ErrorResponse(Versioned):
    code: ErrorCode
    message: str
    server_id: str = ""
