"""`grpo-operator plan` and its arithmetic (`grpo_operator.memory_plan`): the verdicts that matter.

The yardstick (DESIGN §9, issue 10): Qwen3-30B-A3B on 2 x p5.48xlarge, as the flagship example
sets it up, fits in 80 GB per GPU with full sharding; DeepSeek-V3 on the same two nodes does not;
nor does the ZeRO-1 default (`sharding: optimizer`, no FSDP2). `validate` warns when a role cannot fit.
"""

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import yaml
from grpo_operator import instance_types, memory_plan, validation
from grpo_operator.api.job import GRPOJob
from grpo_operator.cli import main
from grpo_operator.memory_plan import GIB, Sharding

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "tests" / "data" / "model-configs"
EXAMPLE = ROOT / "examples" / "p5-qwen3-30b-a3b.yaml"
H100 = instance_types.BUILTIN.get("p5.48xlarge").gpu_memory_bytes


def config(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.config.json").read_text())


def example(path: Path = EXAMPLE) -> GRPOJob:
    return GRPOJob.model_validate(yaml.safe_load(path.read_text()))


def plan(name: str, job: GRPOJob | None = None, **kw) -> memory_plan.Plan:
    job = job or example()
    return memory_plan.plan_job(config(name), job.spec, trainer_gpu_bytes=H100, rollout_gpu_bytes=H100, **kw)


def test_the_instance_table_knows_gpu_memory():
    assert H100 == 81559 * 2**20
    assert instance_types.BUILTIN.get("p5en.48xlarge").gpu_memory_mib == 143771
    assert instance_types.BUILTIN.get("m7i.8xlarge").gpu_memory_bytes is None
    merged = instance_types.BUILTIN.merged({"p5.48xlarge": {"gpuMemoryMiB": 1}})
    assert merged.get("p5.48xlarge").gpu_memory_mib == 1


def test_qwen3_30b_a3b_fits_on_two_p5_with_full_sharding():
    p = plan("qwen3-30b-a3b", sharding="full")
    t = p.trainer
    assert t.fits and t.gpu_bytes == H100
    assert 40 * GIB < t.total < 60 * GIB
    # 30.5 B parameters over 16 ranks: fp32 master 7.1 GiB, AdamW twice that
    assert t.parts["parameters"].bytes == 4 * p.model.total // 16
    assert t.parts["optimizer"].bytes == 2 * t.parts["parameters"].bytes
    assert t.extra["activation_checkpointing"] is True  # needed: ≈ 285 GiB without it
    assert t.extra["activations_gib"]["without_checkpointing"] > 200
    assert t.parts["logits"].bytes < 4 * GIB  # a 1024-token chunk, not 36,864 tokens x 151,936
    assert t.parts["reference"].bytes == 0  # klCoef 0
    assert p.rollout.fits and p.rollout.parts["weights"].bytes == 2 * p.model.total // 8


def test_each_sharding_mode_of_the_trainer_shrinks_what_a_gpu_holds():
    totals = {m: plan("qwen3-30b-a3b", sharding=m).trainer for m in ("none", "optimizer", "full")}
    assert totals["none"].total > totals["optimizer"].total > totals["full"].total
    # the trainer chunks its log-probs in every mode: never the full-vocabulary logits at once
    assert all(t.parts["logits"].bytes < 4 * GIB for t in totals.values())
    assert plan("qwen3-30b-a3b").trainer.extra["sharding"] == "full"  # the example says sharding: full


def test_deepseek_v3_on_the_same_two_nodes_does_not_fit():
    p = plan("deepseek-v3", sharding="full")
    assert p.trainer.fits is False and p.trainer.total > 600 * GIB
    assert p.rollout.fits is False  # 1.3 TB of bf16 weights over TP 8 is more than an H100
    assert "does NOT fit" in p.trainer.verdict()


def test_sharding_modes_order_memory():
    totals = [plan("qwen3-30b-a3b", sharding=str(m)).trainer.total for m in Sharding]
    assert totals == sorted(totals, reverse=True)


def test_kl_adds_a_reference_model():
    job = example()
    job.spec.algorithm.kl_coef = 0.01
    t = plan("qwen3-30b-a3b", job, sharding="full").trainer
    assert t.parts["reference"].bytes == 2 * memory_plan.from_config(config("qwen3-30b-a3b")).total // 16


def test_rollout_kv_cache_per_token():
    q = plan("qwen3-30b-a3b").rollout
    assert q.extra["kv_bytes_per_token"] == 48 * 2 * 1 * 128 * 2  # 4 KV heads < TP 8: one per GPU
    ds = plan("mixtral-8x7b").rollout
    assert ds.extra["kv_bytes_per_token"] == 32 * 2 * 1 * 128 * 2
    mla = plan("deepseek-v3").rollout
    assert mla.extra["kv_bytes_per_token"] == 61 * 576 * 2  # one latent, every TP rank


def test_the_vllm_knobs_move_the_rollout_budget_and_the_context_it_must_hold():
    raw = yaml.safe_load(EXAMPLE.read_text())
    base = plan("qwen3-30b-a3b").rollout
    raw["spec"]["rollout"]["vllm"] = {"gpuMemoryUtilization": 0.5, "maxModelLen": 2048}
    tuned = plan("qwen3-30b-a3b", GRPOJob.model_validate(raw)).rollout
    assert base.budget_bytes == int(H100 * 0.9) and tuned.budget_bytes == int(H100 * 0.5)
    assert tuned.parts["kv_cache"].bytes < base.parts["kv_cache"].bytes
    assert "vLLM gpu_memory_utilization 0.5" in tuned.notes
    raw["spec"]["rollout"]["vllm"] = {"gpuMemoryUtilization": 0.14}  # no room for one 40960-token context
    raw["spec"]["rollout"]["weightSync"] = {"transport": "http"}  # no stream reserve in this room
    starved = plan("qwen3-30b-a3b", GRPOJob.model_validate(raw)).rollout
    raw["spec"]["rollout"]["vllm"]["maxModelLen"] = 1024  # a shorter context fits in the same room
    shorter = plan("qwen3-30b-a3b", GRPOJob.model_validate(raw)).rollout
    assert starved.shortfall and "max_model_len" in starved.shortfall and shorter.shortfall is None


def test_cpu_jobs_have_no_fixed_budget():
    tiny = example(ROOT / "examples" / "tiny-local.yaml")
    p = memory_plan.plan_job(
        config("qwen3-30b-a3b"), tiny.spec, trainer_gpu_bytes=None, rollout_gpu_bytes=None
    )
    assert p.trainer.fits is None and p.rollout.fits is None


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = main(["plan", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_json(capsys):
    qwen = CONFIGS / "qwen3-30b-a3b.config.json"
    code, out, _ = run_cli(capsys, EXAMPLE, "--model-config", qwen, "--json", "--sharding", "full")
    got = json.loads(out)
    assert code == 0
    assert got["trainer"]["fits"] is True and got["trainer"]["gpu_gib"] == pytest.approx(79.65, abs=0.01)
    assert set(got["trainer"]["parts"]) >= {"parameters", "gradients", "optimizer", "activations", "logits"}
    assert set(got["rollout"]["parts"]) == {"weights", "runtime", "weight_stream", "kv_cache"}
    code, out, _ = run_cli(capsys, EXAMPLE, "--model-config", CONFIGS / "deepseek-v3.config.json", "--json")
    assert code == 1 and json.loads(out)["trainer"]["fits_with_sharding"] == []


def test_cli_table(capsys):
    code, out, _ = run_cli(capsys, EXAMPLE, "--model-config", CONFIGS / "qwen3-30b-a3b.config.json")
    assert code == 0 and "does NOT fit" not in out and "parameters" in out and "kv_cache" in out
    code, out, _ = run_cli(capsys, EXAMPLE, "--model-config", CONFIGS / "deepseek-v3.config.json")
    assert code == 1 and "does NOT fit" in out


def test_cli_asks_for_the_config_of_a_remote_model(capsys):
    code, _, err = run_cli(capsys, EXAMPLE)
    assert code == 2 and "--model-config" in err


def test_validate_refuses_a_trainer_that_cannot_fit_and_warns_of_the_rollout(tmp_path, capsys):
    """The trainer would refuse the job at start (grpo_trainer.memory): validate says so as an error;
    the rollout's verdict stays a warning (vLLM measures its own room at start)."""
    model = tmp_path / "models" / "DeepSeek-V3"
    model.mkdir(parents=True)
    shutil.copy(CONFIGS / "deepseek-v3.config.json", model / "config.json")
    raw = yaml.safe_load(EXAMPLE.read_text())
    raw["spec"]["model"]["path"] = "models/DeepSeek-V3"  # relative to the manifest's folder
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(raw))
    warnings: list = []
    problems = validation.validate_file(job, warnings=warnings)
    assert [p.path for p in problems] == ["spec.trainer"] and "does NOT fit" in problems[0].message
    assert [w.path for w in warnings if w.path in ("spec.trainer", "spec.rollout")] == ["spec.rollout"]
    assert main(["validate", str(job)]) == 1
    err = capsys.readouterr().err
    assert ": spec.trainer: trainer:" in err and "warning: spec.rollout: rollout:" in err


def test_full_sharding_splits_experts_over_the_ranks_sharing_an_ep_block():
    """World > EP under full: FSDP2 splits each EP block again in whole experts (ceil per rank)."""
    shape = memory_plan.from_config(config("qwen3-30b-a3b"))  # 128 experts per layer

    def params(world: int, ep: int) -> int:
        inputs, _ = memory_plan.inputs_from_spec(example().spec, sharding="full")
        inputs = dataclasses.replace(inputs, world=world, ep=ep)
        return memory_plan.plan_trainer(shape, inputs, H100).parts["parameters"].bytes

    assert params(16, 8) == params(16, 16) == 4 * shape.total // 16  # 8 experts per rank either way
    assert params(32, 8) == 4 * shape.total // 32
    # 128 / 64 = 2 experts per EP block over 4 ranks: one each for two ranks (whole experts), none for two
    assert params(256, 64) == int(4 * (shape.dense_total / 256 + shape.expert_total / 128))


def test_optimizer_offload_moves_adamw_state_to_host_ram():
    job = example()
    on_gpu = plan("qwen3-30b-a3b", job, sharding="full").trainer
    job.spec.trainer.optimizer_offload = "cpu"
    offloaded = plan("qwen3-30b-a3b", job, sharding="full").trainer
    adam = on_gpu.parts["optimizer"].bytes
    assert offloaded.parts["optimizer"].bytes == 0 and offloaded.total == on_gpu.total - adam
    assert offloaded.host_total == adam + adam // 2  # moments + the fp32 copy the CPU Adam updates
    assert on_gpu.host_total == 0 and "host_gib_per_rank" not in on_gpu.to_json()
    assert offloaded.to_json()["host_gib_per_rank"] == round(offloaded.host_total / GIB, 2)
    assert "host RAM" in offloaded.verdict()


def test_a_token_budget_sets_the_tokens_of_a_micro_batch():
    job = example()
    base = plan("qwen3-30b-a3b", job).trainer
    seq = 1024 + job.spec.algorithm.max_new_tokens  # DEFAULT_PROMPT_TOKENS + completion
    assert base.extra["tokens_per_micro_batch"] == job.spec.algorithm.micro_batch_size * seq
    job.spec.algorithm.max_tokens_per_micro_batch = 2 * seq
    budget = plan("qwen3-30b-a3b", job).trainer
    assert budget.extra["tokens_per_micro_batch"] == 2 * seq
    job.spec.algorithm.max_tokens_per_micro_batch = 16  # shorter than one sequence: it goes alone
    assert plan("qwen3-30b-a3b", job).trainer.extra["tokens_per_micro_batch"] == seq
    assert plan("qwen3-30b-a3b", job).trainer.parts["activations"].bytes < budget.parts["activations"].bytes


def test_the_weight_sync_part_is_two_of_the_jobs_buckets():
    job = example()
    assert plan("qwen3-30b-a3b", job).trainer.parts["weight_sync"].bytes == 2 * 256 * 2**20
    job.spec.rollout.weight_sync.bucket_mb = 1024
    assert plan("qwen3-30b-a3b", job).trainer.parts["weight_sync"].bytes == 2 * 1024 * 2**20


def _seed_trainer(micro: int, budget: int | None = None) -> GRPOJob:
    """DeepSeek-V3 on 16 p5en at EP 128, sharding full (the seed's trainer, DESIGN §12)."""
    job = example()
    spec = job.spec
    spec.trainer.replicas, spec.trainer.instance_type = 16, "p5en.48xlarge"
    spec.trainer.expert_parallel_size, spec.trainer.sharding = 128, "full"
    spec.algorithm.micro_batch_size, spec.algorithm.max_new_tokens = micro, 4096
    spec.algorithm.max_tokens_per_micro_batch = budget
    return job


def _trainer(job: GRPOJob) -> memory_plan.RolePlan:
    gpu = instance_types.BUILTIN.get("p5en.48xlarge").gpu_memory_bytes
    return memory_plan.plan_job(
        config("deepseek-v3"), job.spec, trainer_gpu_bytes=gpu, rollout_gpu_bytes=gpu
    ).trainer


def test_a_trainer_that_does_not_fit_names_the_largest_micro_batch_and_token_budget_that_do():
    too_big = _trainer(_seed_trainer(8))
    assert too_big.fits is False
    best = too_big.extra["largest_fitting"]
    micro, tokens = best["micro_batch_size"], best["max_tokens_per_micro_batch"]
    assert _trainer(_seed_trainer(micro)).fits and not _trainer(_seed_trainer(micro + 1)).fits
    assert _trainer(_seed_trainer(8, tokens)).fits
    assert not _trainer(_seed_trainer(8, tokens + memory_plan.trainer.TOKEN_STEP)).fits
    assert tokens % memory_plan.trainer.TOKEN_STEP == 0
    refusal = too_big.refusal()
    assert f"algorithm.microBatchSize {micro} (was 8)" in refusal
    assert f"maxTokensPerMicroBatch {tokens}" in refusal
    assert _trainer(_seed_trainer(micro)).advice is None  # a trainer that fits gets no advice


def test_a_token_budget_job_is_told_a_budget_and_a_hopeless_one_what_to_change():
    budgeted = _trainer(_seed_trainer(1, 200_000))
    assert budgeted.fits is False and "micro_batch_size" not in budgeted.extra["largest_fitting"]
    assert "maxTokensPerMicroBatch" in budgeted.advice and "microBatchSize" not in budgeted.advice
    hopeless = _seed_trainer(1)
    hopeless.spec.trainer.replicas, hopeless.spec.trainer.expert_parallel_size = 1, 8  # 671 B on 8 GPUs
    plan_ = _trainer(hopeless)
    assert plan_.fits is False and plan_.extra["largest_fitting"] is None
    assert "not even one sequence fits" in plan_.refusal()


def test_vllm_splits_the_experts_over_every_gpu_of_a_server_and_the_dense_weights_over_tp():
    """vLLM 0.32.0 splits a MoE layer's experts over TP x DP GPUs (whole experts under expert
    parallelism, slices without) and each data-parallel replica keeps the dense weights over its TP."""
    raw = yaml.safe_load(EXAMPLE.read_text())
    shape = memory_plan.shapes.from_config(config("deepseek-v3"))
    raw["spec"]["rollout"] |= {"tensorParallelSize": 2}
    raw["spec"]["rollout"]["vllm"] = {"dataParallelSize": 4, "expertParallelSize": 8}
    wide = plan("deepseek-v3", GRPOJob.model_validate(raw)).rollout.parts["weights"].bytes
    assert wide == shape.dense_total * 2 // 2 + shape.expert_total * 2 // 8
    raw["spec"]["rollout"] |= {"tensorParallelSize": 8}
    raw["spec"]["rollout"]["vllm"] = {}
    narrow = plan("deepseek-v3", GRPOJob.model_validate(raw)).rollout.parts["weights"].bytes
    assert narrow == shape.dense_total * 2 // 8 + shape.expert_total * 2 // 8
    assert wide - narrow == shape.dense_total * 2 // 2 - shape.dense_total * 2 // 8  # dense per replica


def test_the_rollout_stream_reserve_is_the_same_at_4_and_16_trainer_nodes():
    """The seed's scale (DeepSeek-V3 on p5en, EP 8 per trainer node): the rollout's weight_stream row is
    the relay's constant, whatever the trainer's size (it was 32 and 128 x 768 MiB before the relay)."""
    raw = yaml.safe_load(EXAMPLE.read_text())
    rows = {}
    for nodes in (4, 16):
        p5en = {"instanceType": "p5en.48xlarge"}
        raw["spec"]["trainer"] |= p5en | {"replicas": nodes, "expertParallelSize": 8}
        raw["spec"]["rollout"] |= p5en
        rollout = plan("deepseek-v3", GRPOJob.model_validate(raw)).rollout
        rows[nodes] = rollout.parts["weight_stream"].bytes
    # the same but for two 16-byte control blocks per trainer rank (the relay's stop flags): 3 KiB
    assert 0 <= rows[16] - rows[4] == 2 * 16 * (128 - 32) and rows[16] <= 1 << 30, rows


def test_the_seeds_48_p5en_fit_with_rollout_servers_spanning_four_nodes():
    """examples/p5en-deepseek-v3.yaml, the seed's own scale (issue 36): 16 trainer nodes at EP 128 and
    8 rollout servers of 4 nodes each. Both roles fit the H200; each rollout GPU holds the dense weights
    and 8 of the 256 experts (TP 1 x DP 32), where a one-node server needed 156 GiB per GPU."""
    job = example(ROOT / "examples" / "p5en-deepseek-v3.yaml")
    h200 = instance_types.BUILTIN.get("p5en.48xlarge").gpu_memory_bytes
    p = memory_plan.plan_job(config("deepseek-v3"), job.spec, trainer_gpu_bytes=h200, rollout_gpu_bytes=h200)
    assert job.spec.rollout.nodes_per_server * job.spec.rollout.replicas == 32
    assert job.spec.trainer.replicas == 16
    assert p.trainer.fits and p.rollout.fits, (p.trainer.total / GIB, p.rollout.total / GIB)
    shape = memory_plan.shapes.from_config(config("deepseek-v3"))
    assert p.rollout.parts["weights"].bytes == 2 * (shape.dense_total + shape.expert_total // 32)
    assert p.rollout.parts["weights"].bytes < 72 * GIB
    # microBatchSize 8 does not fit, and the plan names the largest that does
    raw = yaml.safe_load((ROOT / "examples" / "p5en-deepseek-v3.yaml").read_text())
    raw["spec"]["algorithm"]["microBatchSize"] = 8
    eight = memory_plan.plan_job(
        config("deepseek-v3"),
        GRPOJob.model_validate(raw).spec,
        trainer_gpu_bytes=h200,
        rollout_gpu_bytes=h200,
    )
    assert not eight.trainer.fits and "algorithm.microBatchSize 5 (was 8)" in eight.trainer.advice
