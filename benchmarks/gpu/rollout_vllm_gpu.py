"""Pass/fail GPU check of the vLLM rollout engine on ONE H100/H200 (a few minutes; never in CI).

Run from the repository root in the rollout image (vLLM pins its own torch, so not the trainer's):
`python benchmarks/gpu/rollout_vllm_gpu.py --json $OUT/rollout_vllm.json`; exit status 0 when every
check passed, 1 otherwise. No download: it builds a small random Qwen3-MoE (8 experts, top-2,
tied embeddings, head_dim 64 so every attention backend takes it) with the character tokenizer,
both from `grpo_trainer.tiny_model`.

Checks (each a row):
1. start: `VllmEngine` (AsyncLLM, routed-experts capture on, eager) comes up.
2. batching: two `generate` calls from two threads at once, 4 prompts x n = 4 each: every prompt
   gets 4 samples, one log-prob per token, finite and <= 0.
3. logprobs: at temperature 1, top_p 1, vLLM's sampled-token log-probs equal log_softmax of the HF
   model's logits at those tokens (bf16: mean |diff| <= 0.02, max <= 0.25).
4. routing: each sample's routing is [prompt + completion - 1, MoE layers, k], expert ids < 8.
5. streamed update: a second model's weights (transformers' fused names, no `lm_head.weight`: it
   is tied) through `begin_update` / `load_bucket` (one tensor split over two buckets) /
   `finish_update`; then the log-probs match the second model (post-load processing ran).
6. HTTP update: the first model back through `load_weights` (safetensors buckets); log-probs match
   the first model again.
7. versions: through the rollout server's service (the engine above is the one it started): four
   generate requests in flight while version 1 (the second model) is pushed; each answer names one
   version, the push waits for them, and a request needing version 1 gets the second model.
8. deepep_v2 (issue 36): vLLM's DeepEP v2 all2all inside one node. With 2+ GPUs a `VllmEngine` of
   data-parallel size = expert-parallel size = the GPUs (up to 8), `all2all_backend="deepep_v2"`,
   generates 2 samples for each of 8 prompts with finite log-probs. vLLM runs an all2all backend
   only where experts are spread over data-parallel ranks, so one GPU is "skipped" with that reason
   and what it can show: whether vLLM's own gate (`deep_ep_v2_unavailable_reason`: DeepEP with
   `ElasticBuffer`, NCCL >= 2.30.4 for GIN) passes in this image. Across EFA nodes is not here.
9. reward_vllm (issue 22): the reward model server's vllm engine on CUDA. A tiny sequence classifier
   (bf16) through vLLM's pooling runner scores transformers' logits (max |diff| <= REWARD_TOL: the
   head's raw logit, not vLLM's default sigmoid); a generative judge over min(2, GPUs)
   tensor-parallel workers answers every item (a text each, scored or counted as a parse failure).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for sub in ("rollout", "operator", "trainers"):  # trainers: only its tiny_model (torch, transformers)
    sys.path.insert(0, str(ROOT / sub))

MEAN_TOL, MAX_TOL = 0.02, 0.25
REWARD_TOL = 0.05  # bf16 logits of a 512-wide head: a few ulps of values near 1


def build_model(directory: Path, seed: int) -> Path:
    """The product's tiny builder (`grpo_trainer.tiny_model`, its character tokenizer) at this check's
    size, random weights in bf16."""
    import torch
    from grpo_trainer.tiny_model import TinyConfig, save_untrained

    cfg = TinyConfig(
        hidden=512,
        heads=8,
        kv_heads=4,
        head_dim=64,
        expert_width=256,
        max_positions=1024,
        tied=True,
        seed=seed,
    )
    return save_untrained(directory, cfg, dtype=torch.bfloat16)


def hf_logprobs(model_dir: Path, prompt_ids: list[int], token_ids: list[int]) -> list[float]:
    """log_softmax of the HF model's logits at the sampled tokens (temperature 1, top_p 1)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.bfloat16).cuda().eval()
    ids = torch.tensor([prompt_ids + token_ids], device="cuda")
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float()
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(1, torch.tensor(token_ids, device="cuda")[:, None])[:, 0].tolist()


def compare(engine, model_dir: Path, prompts: list[str]) -> dict:
    """vLLM's log-probs of its own samples vs the HF model's, over every sampled token."""
    from grpo_wire.protocol import Sampling

    out = engine.generate(prompts, 2, Sampling(temperature=1.0, top_p=1.0, max_new_tokens=16), lambda: False)
    diffs = []
    for ps in out:
        for s in ps.samples:
            ref = hf_logprobs(model_dir, ps.prompt_token_ids, s.token_ids)
            diffs += [abs(a - b) for a, b in zip(s.logprobs, ref, strict=True)]
    mean, worst = sum(diffs) / len(diffs), max(diffs)
    return {
        "tokens": len(diffs),
        "mean_abs": mean,
        "max_abs": worst,
        "ok": mean <= MEAN_TOL and worst <= MAX_TOL,
    }


async def versions(service, bucket: bytes) -> tuple[list, object, object]:
    """Generations in flight while a version is pushed over the HTTP path's service method."""
    from grpo_wire.protocol import GenerateRequest, Prompt, Sampling, WeightBucket

    def request(rid: str, min_version: int | None = None) -> GenerateRequest:
        prompts = [Prompt(id=str(i), text=f"{i} * {i} = ") for i in range(4)]
        sampling = Sampling(max_new_tokens=32)
        return GenerateRequest(
            request_id=rid, prompts=prompts, n=4, sampling=sampling, min_weight_version=min_version
        )

    running = [asyncio.create_task(service.generate(request(f"r{k}"))) for k in range(4)]
    await asyncio.sleep(0.05)  # the requests are in vLLM when the push arrives
    pushed = await service.add_weights(WeightBucket(version=1, index=0, count=1), bucket)
    answers = await asyncio.gather(*running)
    after = await service.generate(request("after", min_version=1))
    return answers, pushed, after


def deepep_v2_row(model_dir: Path) -> dict:
    """Check 8: vLLM's deepep_v2 all2all on this node's GPUs (see the module docstring)."""
    import torch
    from vllm.utils.import_utils import deep_ep_v2_unavailable_reason

    gpus = min(torch.cuda.device_count(), 8)
    gate = deep_ep_v2_unavailable_reason()
    shown = {"gpus": gpus, "vllm_gate": gate or "passes (DeepEP ElasticBuffer, NCCL >= 2.30.4)"}
    if gpus < 2:
        why = (
            f"{gpus} GPU: vLLM runs an all2all backend only with experts spread over 2+ data-parallel ranks "
            "(FusedMoEParallelConfig.use_all2all_kernels, fused_moe/config.py:1026-1029 of 0.32.0)"
        )
        return {"result": "skipped", "why": why, **shown}
    if gate is not None:
        return {"result": "FAIL", "why": f"vLLM refuses deepep_v2 in this image: {gate}", **shown}
    from grpo_rollout.engines.vllm_engine import VllmEngine, VllmEngineConfig, VllmOptions
    from grpo_wire.protocol import Sampling

    opts = VllmOptions(
        gpu_memory_utilization=0.5, max_model_len=512, enforce_eager=True,
        data_parallel_size=gpus, expert_parallel=True, all2all_backend="deepep_v2",
    )  # fmt: skip
    engine = VllmEngine(VllmEngineConfig(model_path=str(model_dir), dtype="bfloat16", vllm=opts))
    try:
        t0 = time.monotonic()
        out = engine.generate(
            [f"{i} + {i} = " for i in range(8)], 2, Sampling(max_new_tokens=24), lambda: False
        )
        samples = [s for ps in out for s in ps.samples]
        finite = all(
            len(s.logprobs) == len(s.token_ids) and all(map(math.isfinite, s.logprobs)) for s in samples
        )
        ok = len(samples) == 16 and finite
        return {
            "result": "pass" if ok else "FAIL",
            "samples": len(samples),
            "seconds": round(time.monotonic() - t0, 1),
            **shown,
        }
    finally:
        engine.llm.shutdown()


def reward_vllm_row(work: Path, judge_dir: Path) -> dict:
    """Check 9: the reward model server's vllm engine (see the module docstring)."""
    import torch
    from grpo_operator.api.spec import RewardModelSpec
    from grpo_rollout.reward_model.base import LoadConfig, load
    from grpo_trainer.tiny_model import TinyConfig, save_reward_classifier
    from grpo_wire.protocol import ScoreItem

    rm = save_reward_classifier(
        work / "rm", TinyConfig(hidden=512, heads=8, kv_heads=4), dtype=torch.bfloat16
    )
    items = [ScoreItem(prompt=f"{i} + {i} = ", completion=str(2 * i + i % 3)) for i in range(8)]
    t0 = time.monotonic()
    spec = {"path": str(rm), "batchSize": 8}
    on_vllm = load("classifier", LoadConfig(str(rm), "auto", "bfloat16"),
                   RewardModelSpec.model_validate({**spec, "engine": "vllm"}))  # fmt: skip
    scores, _ = on_vllm.score(items)
    on_vllm.close()
    on_torch = load(
        "classifier", LoadConfig(str(rm), "cuda", "bfloat16"), RewardModelSpec.model_validate(spec)
    )
    expected, _ = on_torch.score(items)
    diff = max(abs(a - b) for a, b in zip(scores, expected, strict=True))
    tp = min(torch.cuda.device_count(), 2)
    judge_spec = RewardModelSpec.model_validate(
        {"path": str(judge_dir), "kind": "generative", "engine": "vllm", "tensorParallelSize": tp,
         "prompt": "Rate: {prompt} {completion}", "maxNewTokens": 16}
    )  # fmt: skip
    judge = load("generative", LoadConfig(str(judge_dir), "auto", "bfloat16"), judge_spec)
    judged, errors = judge.score(items)
    answered = len(judged) == len(items) and all(e is None or e.startswith("no score") for e in errors)
    judge.close()
    ok = diff <= REWARD_TOL and answered
    return {
        "result": "pass" if ok else "FAIL",
        "classifier_max_diff": round(diff, 4),
        "judge_tensor_parallel": tp,
        "judge_scored": sum(e is None for e in errors),
        "seconds": round(time.monotonic() - t0, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    rows: list[dict] = []

    def check(name: str, passed: bool, **info) -> None:
        rows.append({"check": name, "result": "pass" if passed else "FAIL", **info})
        print(rows[-1], flush=True)

    work = Path(tempfile.mkdtemp(prefix="vllm-check-"))
    engine = service = None
    try:
        import torch
        from grpo_operator.api.spec import RewardSpec
        from grpo_rollout.engines.vllm_engine import VllmEngineConfig, VllmOptions
        from grpo_rollout.service import RolloutService, ServiceConfig
        from grpo_wire.protocol import Sampling
        from safetensors.torch import load_file, save
        from transformers import AutoModelForCausalLM

        first, second = build_model(work / "a", seed=0), build_model(work / "b", seed=1)
        t0 = time.monotonic()
        opts = VllmOptions(
            gpu_memory_utilization=0.5, max_model_len=512, enforce_eager=True, routed_experts=True
        )
        config = VllmEngineConfig(model_path=str(first), dtype="bfloat16", vllm=opts)
        service = RolloutService(
            ServiceConfig(
                server_id="gpu-check",
                engine="vllm",
                engine_config=config,
                reward=RewardSpec.model_validate({"functions": [{"builtin": "math"}]}),
            )
        )
        asyncio.run(service.start())
        engine = service.engine
        check("start", True, seconds=round(time.monotonic() - t0, 1))

        prompts = [f"{i} + {i} = " for i in range(8)]
        sampling = Sampling(temperature=1.0, top_p=1.0, max_new_tokens=24, seed=7)
        results: dict[int, list] = {}

        def call(k: int) -> None:
            results[k] = engine.generate(prompts[4 * k : 4 * k + 4], 4, sampling, lambda: False, routing=True)

        threads = [threading.Thread(target=call, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        samples = [s for k in results for ps in results[k] for s in ps.samples]
        shaped = all(len(ps.samples) == 4 for k in results for ps in results[k]) and len(samples) == 32
        finite = all(
            len(s.logprobs) == len(s.token_ids) and all(math.isfinite(x) and x <= 1e-4 for x in s.logprobs)
            for s in samples
        )
        check("batching", shaped and finite, samples=len(samples))

        routed = []
        for k in results:
            for ps in results[k]:
                for s in ps.samples:
                    r = s.routing
                    ok = r is not None and r.shape == (len(ps.prompt_token_ids) + len(s.token_ids) - 1, 2, 2)
                    routed.append(ok and max(r.raw()) < 8)
        check("routing", all(routed), sequences=len(routed))

        row = compare(engine, first, prompts[:2])
        check("logprobs", row.pop("ok"), **row)

        state = AutoModelForCausalLM.from_pretrained(second, torch_dtype=torch.bfloat16).state_dict()
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}  # tied: the trainer omits it
        engine.begin_update({k: tuple(v.shape) for k, v in state.items()})
        names = sorted(state)
        split = names[0]
        flat = state[split].reshape(-1)
        half = flat.numel() // 2
        engine.load_bucket(
            [(split, 0, flat[:half].cuda())] + [(n, 0, state[n].reshape(-1).cuda()) for n in names[1::2]]
        )
        engine.load_bucket(
            [(split, half, flat[half:].cuda())] + [(n, 0, state[n].reshape(-1).cuda()) for n in names[2::2]]
        )
        updated = engine.finish_update()
        row = compare(engine, second, prompts[:2])
        check("streamed_update", row.pop("ok") and updated > 0, tensors=updated, **row)

        back = load_file(str(first / "model.safetensors"))
        keys = sorted(back)
        buckets = [save({k: back[k] for k in keys[i::3]}) for i in range(3)]
        updated = engine.load_weights(buckets)
        row = compare(engine, first, prompts[:2])
        check("http_update", row.pop("ok") and updated > 0, tensors=updated, **row)

        second_bucket = save(load_file(str(second / "model.safetensors")))
        answers, pushed, after = asyncio.run(versions(service, second_bucket))
        consistent = all(a.weight_version in (0, 1) for a in answers) and pushed.applied
        row = compare(engine, second, prompts[:2])
        ok = consistent and after.weight_version == 1 and row.pop("ok")
        check("versions", ok, answered=[a.weight_version for a in answers], live=pushed.live_version, **row)
        engine.llm.shutdown()  # its GPU memory goes back before check 8 starts its own engines
        service.close()
        engine = service = None
        rows.append({"check": "deepep_v2", **deepep_v2_row(first)})
        print(rows[-1], flush=True)
        rows.append({"check": "reward_vllm", **reward_vllm_row(work, first)})
        print(rows[-1], flush=True)
    except Exception:
        check("run", False, error=traceback.format_exc()[-2000:])
    finally:
        if engine is not None:
            engine.llm.shutdown()
        if service is not None:
            service.close()
    failed = [r for r in rows if r["result"] == "FAIL"]
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "passed": not failed}, indent=2))
    print("PASS" if not failed else f"FAIL: {[r['check'] for r in failed]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
