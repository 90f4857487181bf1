"""The torch engine: an HF causal LM sampled with our own KV-cached decode loop (CPU or one GPU).

Used by the rollout server when the job says `rollout.engine: torch` (the local runtime and CPU
tests). HF `generate` is avoided on purpose: our loop owns temperature/top-p and records the exact
log-prob of every sampled token under the sampling policy, which the trainer's importance
correction relies on. With `routing=True` it also records the experts every MoE layer chose for
every prompt and sampled token (`grpo_rollout.engines.routing`), for routing replay in the trainer.
Weight updates copy HF-named tensors into the live model in place: whole versions (`load_weights`)
or streamed element ranges (`begin_update` / `load_bucket` / `finish_update`), so a streamed
version needs no memory beyond the received bucket. A tied `lm_head.weight` shares storage with
the input embedding: updating either updates both.
"""

import contextlib
import inspect
import logging
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from grpo_wire.protocol import Sampling

from grpo_rollout.engines.base import ENGINES, BucketPiece, EngineConfig, PromptSamples, Sample, Stopped
from grpo_rollout.engines.hf_names import check_shapes
from grpo_rollout.engines.routing import RoutingRecorder, encode_routing
from grpo_rollout.engines.sampling import sample_step

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


@ENGINES.register("torch")
class TorchEngine:
    name = "torch"

    @classmethod
    def config_for(cls, spec: object, **common: Any) -> EngineConfig:
        """The job's engine config: the common fields, nothing else of the spec."""
        return EngineConfig(**common)

    def __init__(self, config: EngineConfig):
        from transformers import AutoModelForCausalLM, AutoTokenizer  # heavy; only when this engine is chosen

        if config.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {config.dtype!r}; choose one of {sorted(DTYPES)}")
        self.device = resolve_device(config.device)
        self.max_batch_size = config.max_batch_size
        self.tokenizer = AutoTokenizer.from_pretrained(config.model_path)
        model = AutoModelForCausalLM.from_pretrained(config.model_path, dtype=DTYPES[config.dtype])
        self.model = model.to(self.device).eval()
        eos = model.generation_config.eos_token_id if model.generation_config is not None else None
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        if self.tokenizer.eos_token_id is not None:
            eos_ids.append(self.tokenizer.eos_token_id)
        eos_ids = sorted(set(eos_ids))
        self.eos_ids = torch.tensor(eos_ids, dtype=torch.long, device=self.device)
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (eos_ids[0] if eos_ids else 0)
        # HF names -> tensors sharing storage with the live model (tied names included).
        self._targets = self.model.state_dict()
        self._updating: set[str] = set()  # names announced by begin_update
        # transformers >= 5.2x renamed `past_key_values` to `cache`; we own the cache object either way.
        self._cache_kw = (
            "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        )
        log.info(
            "torch engine: %s on %s (%s), eos ids %s", config.model_path, self.device, config.dtype, eos_ids
        )

    def encode(self, text: str) -> list[int]:
        ids = self.tokenizer(text)["input_ids"]
        if not ids:
            raise ValueError("prompt tokenizes to no tokens; give at least one character")
        return ids

    def generate(
        self,
        prompts: Sequence[str | list[int]],
        n: int,
        sampling: Sampling,
        should_stop: Callable[[], bool],
        *,
        routing: bool = False,
    ) -> list[PromptSamples | None]:
        encoded = [self.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        if any(not ids for ids in encoded):
            raise ValueError("a prompt has no tokens; give at least one character")
        recorder = RoutingRecorder(self.model) if routing else None
        generator = torch.Generator(device=self.device)
        generator.manual_seed(sampling.seed if sampling.seed is not None else random.getrandbits(63))
        per_chunk = max(1, self.max_batch_size // n)  # whole prompts per decode batch
        out: list[PromptSamples | None] = [None] * len(prompts)
        for start in range(0, len(prompts), per_chunk):
            chunk = encoded[start : start + per_chunk]
            try:
                samples = self._decode(chunk, n, sampling, generator, should_stop, recorder)
            except Stopped:
                break  # this chunk and the rest stay None: handed back
            for i, ids in enumerate(chunk):
                out[start + i] = PromptSamples(prompt_token_ids=ids, samples=samples[i * n : (i + 1) * n])
        return out

    @torch.inference_mode()
    def _decode(
        self,
        prompts: list[list[int]],
        n: int,
        sampling: Sampling,
        generator: torch.Generator,
        should_stop: Callable[[], bool],
        recorder: RoutingRecorder | None = None,
    ) -> list[Sample]:
        """n samples per prompt, prompt-major. The prompts are prefilled once and their KV cache is
        repeated n times, so a group of n costs one prompt forward, not n. A recorder only reads
        the routers' outputs: sampling is the same with or without it."""
        with recorder.recording() if recorder is not None else contextlib.nullcontext():
            return self._decode_batch(prompts, n, sampling, generator, should_stop, recorder)

    def _decode_batch(
        self,
        prompts: list[list[int]],
        n: int,
        sampling: Sampling,
        generator: torch.Generator,
        should_stop: Callable[[], bool],
        recorder: RoutingRecorder | None,
    ) -> list[Sample]:
        from transformers import DynamicCache

        longest = max(len(r) for r in prompts)
        ids = torch.full((len(prompts), longest), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), longest), dtype=torch.long)
        for i, r in enumerate(prompts):  # left padding: every row's next token sits in the last column
            ids[i, longest - len(r) :] = torch.tensor(r)
            mask[i, longest - len(r) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [P, L] pads share position 0, masked anyway
        cache = DynamicCache(config=self.model.config)  # filled in place by each forward
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kw: cache},
        )
        cache.batch_repeat_interleave(n)  # [P, ...] -> [P * n, ...]
        routes = []  # per forward: [B, tokens fed, layers, k]
        if recorder is not None:
            routes.append(recorder.take().unflatten(0, (len(prompts), longest)).repeat_interleave(n, dim=0))
        logits = out.logits[:, -1, :].repeat_interleave(n, dim=0)  # [B = P * n, V]
        mask = mask.repeat_interleave(n, dim=0)  # [B, L]
        positions = positions[:, -1:].repeat_interleave(n, dim=0)  # [B, 1]
        finished = torch.zeros(logits.shape[0], dtype=torch.bool, device=self.device)
        step_tokens, step_logps, step_alive = [], [], []
        for step in range(sampling.max_new_tokens):
            if should_stop():
                raise Stopped()
            tokens, logps = sample_step(logits, sampling.temperature, sampling.top_p, generator)
            step_alive.append(~finished)
            tokens = torch.where(finished, torch.full_like(tokens, self.pad_id), tokens)
            step_tokens.append(tokens)
            step_logps.append(logps)
            finished = finished | torch.isin(tokens, self.eos_ids)
            if bool(finished.all()) or step + 1 == sampling.max_new_tokens:
                break
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)  # [B, L + t]
            positions = positions + 1  # [B, 1]
            out = self.model(
                input_ids=tokens[:, None],
                attention_mask=mask,
                position_ids=positions,
                use_cache=True,
                **{self._cache_kw: cache},
            )
            logits = out.logits[:, -1, :]  # [B, V]
            if recorder is not None:
                routes.append(recorder.take().unsqueeze(1))  # token `step` of every row: [B, 1, layers, k]
        tokens_bt = torch.stack(step_tokens, 1).cpu()  # [B, T]
        logps_bt = torch.stack(step_logps, 1).cpu()  # [B, T]
        alive_bt = torch.stack(step_alive, 1).cpu()  # [B, T]
        finished = finished.cpu()
        routes_bt = torch.cat(routes, dim=1).cpu() if routes else None  # [B, longest + forwards, layers, k]
        samples = []
        for i in range(tokens_bt.shape[0]):
            keep = alive_bt[i]
            token_ids = tokens_bt[i][keep].tolist()
            routing = None
            if recorder is not None and routes_bt is not None:
                # the row's prompt (left-padded) and its tokens fed back: all but the last sampled one
                prompt_len = len(prompts[i // n])
                rows = routes_bt[i, longest - prompt_len : longest + len(token_ids) - 1]
                routing = encode_routing(rows, recorder.num_experts)
            samples.append(
                Sample(
                    token_ids=token_ids,
                    logprobs=logps_bt[i][keep].tolist(),
                    finish_reason="stop" if bool(finished[i]) else "length",
                    text=self.tokenizer.decode(token_ids, skip_special_tokens=True),
                    routing=routing,
                )
            )
        return samples

    def _check(self, shapes: Mapping[str, Sequence[int]]) -> None:
        """ValueError naming unknown names and shape mismatches (nothing changed yet)."""
        check_shapes(shapes, {k: t.shape for k, t in self._targets.items()}, "model")

    def begin_update(self, tensors: Mapping[str, Sequence[int]]) -> None:
        self._check(tensors)
        self._updating = set(tensors)

    def load_bucket(self, pieces: Sequence[BucketPiece]) -> None:
        with torch.no_grad():
            for name, start, values in pieces:
                if name not in self._updating:
                    raise ValueError(f"piece of {name!r}, which the update did not announce")
                flat = self._targets[name].view(-1)  # parameters are contiguous: a view of the live weights
                flat[start : start + values.numel()].copy_(values)

    def destination(
        self, name: str, start: int, count: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor | None:
        """The live parameter's bytes (`InPlaceUpdate`): the stream writes the new values there."""
        target = self._targets.get(name)
        if name not in self._updating or target is None or target.dtype != dtype:
            return None
        if target.device != torch.device(device) or not target.is_contiguous() or start < 0:
            return None
        flat = target.detach().view(-1)[start : start + count]
        return flat.view(torch.uint8) if flat.numel() == count else None

    def finish_update(self) -> int:
        updated, self._updating = len(self._updating), set()
        return updated

    def abort_update(self) -> None:
        self._updating = set()

    def load_weights(self, buckets: Sequence[bytes]) -> int:
        """Validate every tensor of the version first, then copy them all: no half-applied version."""
        from safetensors.torch import load

        incoming: dict[str, torch.Tensor] = {}
        for data in buckets:
            incoming.update(load(data))
        self._check({k: v.shape for k, v in incoming.items()})
        with torch.no_grad():
            for name, tensor in incoming.items():
                self._targets[name].copy_(tensor)
        return len(incoming)
