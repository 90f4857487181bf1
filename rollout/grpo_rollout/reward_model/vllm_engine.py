"""The vllm engine of the reward model server (spec.reward.model.engine: vllm), over tensorParallelSize GPUs.

Both kinds, through vLLM's offline `LLM` on the server's model thread (read against vllm 0.32.0):
- generative: `LLM.generate` (entrypoints/llm.py:418), greedy, `maxNewTokens`, the judge's prompt and
  score read exactly as the torch judge does (`judge.render`, `judge.parse_score`);
- classifier: the model as vLLM's pooling runner (`runner="pooling"`) and `LLM.classify`
  (entrypoints/pooling/offline.py:241) with `PoolingParams(use_activation=False)`
  (pooling_params.py:55): without it vLLM puts a one-output head through a sigmoid, and the score
  must be the logit, as transformers gives it (the torch classifier).
Inputs are token ids, tokenized here from the same chat-formatted text the torch engine builds (no
special tokens added twice). vLLM refuses a prompt past its max_model_len (maxModelLen, else the
model's context; read back from LLMEngine.model_config, v1/engine/llm_engine.py:70), which would
fail the whole batch: such an item scores 0 with the reason instead, and the rest are scored.
On vLLM's CPU build (the tests, `grpo-operator run`), `vllm_cpu` sizes the KV cache and binds each
tensor-parallel worker's threads.
"""

import os
from typing import Any

from grpo_operator.memory_plan.reward import shape as reward_shape
from grpo_wire.protocol import ScoreItem

from grpo_rollout.engines import vllm_cpu
from grpo_rollout.reward_model.base import ENGINES, LoadConfig, Misconfigured, RewardModel
from grpo_rollout.reward_model.classifier import check_single_output, classifier_input
from grpo_rollout.reward_model.judge import Judging, NoAnswer, judge_input

MISSING = "spec.reward.model.engine vllm needs vLLM in the reward pod's image (the rollout image has it)"
KV_TOKENS_CAP = 4096  # CPU only: the longest sequence the KV cache is sized for, past the model's own limit


def engine_args(config: LoadConfig, spec: Any, *, pooling: bool) -> dict[str, Any]:
    """Keyword arguments of vLLM's `LLM` for this reward model (pure: the CPU additions come later)."""
    if config.device not in ("auto", "cuda", "cpu"):
        raise ValueError(f"--device {config.device!r}: the vllm engine picks its devices (auto)")
    args: dict[str, Any] = {
        "model": config.path,
        "dtype": config.dtype,
        "tensor_parallel_size": spec.tensor_parallel_size,
        "max_num_seqs": spec.batch_size,
        "seed": 0,
        "disable_log_stats": True,
    }
    if spec.max_model_len is not None:
        args["max_model_len"] = spec.max_model_len
    if pooling:
        args["runner"] = "pooling"
    return args


def cpu_args(config: LoadConfig, args: dict[str, Any]) -> dict[str, Any]:
    """What vLLM's CPU build needs besides `args`: eager mode (no compile at start), a KV cache the
    batch fits in, head widths its attention takes (refused naming the path), thread binding."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    model_config = vllm_cpu.model_config(config.path)
    supported = CPUAttentionBackend.get_supported_head_sizes()
    fields = {"field": "spec.reward.model.path", "engine_field": "spec.reward.model.engine"}
    if refusal := vllm_cpu.head_dim_refusal(model_config, supported, **fields):
        raise Misconfigured(refusal)
    extra: dict[str, Any] = {"enforce_eager": True}
    length = args.get("max_model_len") or min(
        int(model_config.get("max_position_embeddings") or KV_TOKENS_CAP), KV_TOKENS_CAP
    )
    extra["max_model_len"] = length
    if not os.environ.get(vllm_cpu.KV_SPACE_ENV):
        shape = reward_shape(model_config)  # the memory plan's reading of a reward model's config
        per_token = shape.layers * shape.kv_dim * vllm_cpu.DTYPE_BYTES.get(str(args["dtype"]), 4)
        extra["kv_cache_memory_bytes"] = max(per_token * length * args["max_num_seqs"], vllm_cpu.MIN_KV_BYTES)
    tp = int(args["tensor_parallel_size"])
    if tp > 1 and not os.environ.get(vllm_cpu.THREADS_BIND_ENV):
        os.environ[vllm_cpu.THREADS_BIND_ENV] = vllm_cpu.thread_binding(tp, sorted(os.sched_getaffinity(0)))
    return extra


def start(config: LoadConfig, spec: Any, *, pooling: bool) -> Any:
    """vLLM's `LLM` for this model, on vLLM's own platform (CUDA, else its CPU build)."""
    try:
        from vllm import LLM
        from vllm.platforms import current_platform
    except ImportError as e:
        raise RuntimeError(f"{MISSING} ({e})") from e
    args = engine_args(config, spec, pooling=pooling)
    if current_platform.device_type == "cpu":
        args |= cpu_args(config, args)
    return LLM(**args)


def stop(llm: Any) -> None:
    """End vLLM's engine processes now (its LLMEngine.engine_core client, v1/engine/llm_engine.py:116),
    so their GPU memory is back before the next engine starts."""
    llm.llm_engine.engine_core.shutdown()


def token_ids(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """The ids of already-formatted texts, without special tokens added again."""
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def fitting(ids: list[list[int]], limit: int, reserve: int = 0) -> tuple[list[int], list[str | None]]:
    """(the indices of inputs that fit `limit` tokens with `reserve` more, each input's error or None):
    vLLM refuses a longer prompt, which would fail the whole batch; it scores 0 with the reason instead."""
    errors: list[str | None] = [None] * len(ids)
    for i, one in enumerate(ids):
        if len(one) + reserve > limit:
            more = f" + {reserve} for the judgement" if reserve else ""
            errors[i] = (
                f"input of {len(one)} tokens{more} is over the {limit} the reward server takes "
                "(spec.reward.model.maxModelLen, default the model's context)"
            )
    return [i for i, e in enumerate(errors) if e is None], errors


def max_len(llm: Any) -> int:
    """The longest sequence the engine takes (vLLM's ModelConfig.max_model_len, as it resolved it)."""
    return int(llm.llm_engine.model_config.max_model_len)


class VllmJudge(Judging):
    engine = "reward-generative-vllm"

    def __init__(self, config: LoadConfig, spec: Any):
        self.configure(spec)
        self.llm = start(config, spec, pooling=False)
        self.tokenizer = self.llm.get_tokenizer()
        from vllm import SamplingParams

        self.params = SamplingParams(temperature=0.0, max_tokens=spec.max_new_tokens)
        self.limit = max_len(self.llm)

    def generate(self, messages: list[str]) -> list[str | NoAnswer]:
        """The judge's greedy answers, in order; vLLM batches them (up to batchSize at once). An input
        too long for the engine gets `NoAnswer` with the reason."""
        ids = token_ids(self.tokenizer, [judge_input(self.tokenizer, m) for m in messages])
        keep, errors = fitting(ids, self.limit, self.params.max_tokens)
        prompts = [{"prompt_token_ids": ids[i]} for i in keep]
        outputs = self.llm.generate(prompts, self.params, use_tqdm=False) if prompts else []
        texts = {i: o.outputs[0].text for i, o in zip(keep, outputs, strict=True)}
        return [texts[i] if why is None else NoAnswer(why) for i, why in enumerate(errors)]

    def close(self) -> None:
        stop(self.llm)


class VllmClassifier:
    engine = "reward-classifier-vllm"

    def __init__(self, config: LoadConfig, spec: Any):
        from transformers import AutoConfig

        check_single_output(config.path, AutoConfig.from_pretrained(config.path))
        self.llm = start(config, spec, pooling=True)
        self.tokenizer = self.llm.get_tokenizer()
        from vllm.pooling_params import PoolingParams

        self.params = PoolingParams(use_activation=False)  # the logit, not its sigmoid
        self.limit = max_len(self.llm)

    def close(self) -> None:
        stop(self.llm)

    def score(self, items: list[ScoreItem]) -> tuple[list[float], list[str | None]]:
        ids = token_ids(self.tokenizer, [classifier_input(self.tokenizer, item) for item in items])
        keep, errors = fitting(ids, self.limit)
        prompts = [{"prompt_token_ids": ids[i]} for i in keep]
        outputs = self.llm.classify(prompts, pooling_params=self.params, use_tqdm=False) if prompts else []
        scores = [0.0] * len(items)
        for i, o in zip(keep, outputs, strict=True):
            scores[i] = float(o.outputs.probs[0])
        return scores, errors


@ENGINES.register("vllm")
def load_vllm(kind: str, config: LoadConfig, spec: Any) -> RewardModel:
    models = {"generative": VllmJudge, "classifier": VllmClassifier}
    if kind not in models:
        raise ValueError(f"reward model kind {kind!r}: the vllm engine serves {sorted(models)}")
    return models[kind](config, spec)
