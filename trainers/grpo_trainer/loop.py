"""The GRPO training loop one rank runs: one readable loop in a fixed order, nanoGPT style.

Started by `python -m grpo_trainer rank` (one process per rank, spawned by the per-pod
launcher `grpo_trainer.launcher`). Per step, in this order:
  1. rollouts  rank 0 takes the step's prompts from the rollout servers and broadcasts them;
               with maxStaleness = k > 0 the next k steps are already being generated
               while this one trains
               (dynamicSampling: further draws until promptsPerStep groups carry a signal)
  2. scoring   rewards → advantages; zero-variance groups dropped (every rank, same result)
  3. updates   epochsPerStep x miniBatchesPerStep optimizer updates (docs/objective.md,
               `grpo_trainer.step.Learner`), each: micro-steps (each rank forwards/backwards its
               share, loss normalised by the mini-batch's totals), gradient sync, clip, AdamW step
  4. weights   version v+1 to the rollout servers (`grpo_trainer.pusher.WeightPusher`): every rank
               streams what it holds (collective), or rank 0 POSTs the gathered model (http)
  5. log / checkpoint  (with dataset.eval, rank 0 first scores the held-out set when due:
               `grpo_trainer.evaluation`; also once before step 1, the baseline)
"""

import logging
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass

import torch
import torch.distributed as dist
from grpo_operator import storage
from grpo_operator.api.contract import RunContract
from torch import nn

from grpo_trainer import checkpoint, memory, moe, prompts, weight_sync
from grpo_trainer.batch import Rollouts, effective_prefix, untrained_reason
from grpo_trainer.config import RankInfo, job_token
from grpo_trainer.data import DATASET_FIELD, PromptOrder, RowShape, load_rows
from grpo_trainer.evaluation import Evaluator
from grpo_trainer.generation import Generator
from grpo_trainer.inputs import check_inputs
from grpo_trainer.losses import LossConfig
from grpo_trainer.optim import GangAdamW
from grpo_trainer.parallel import (
    StopRequest,
    broadcast_bytes,
    broadcast_json,
    ep_tokens_per_dispatch,
    init_distributed,
    load_policy,
    make_groups,
)
from grpo_trainer.progress import ProgressReporter, StepSeconds, step_report
from grpo_trainer.pusher import WeightPusher
from grpo_trainer.step import Learner

log = logging.getLogger(__name__)
Prefetch = Future  # a Future[Rollouts] from `Generator.submit`
CATCH_UP_POLL_S = 5.0  # how often rank 0, waiting for rollouts, looks for servers behind the live weights


@dataclass
class Run:
    """Everything the loop works with, built once by `setup`."""

    contract: RunContract
    info: RankInfo
    learner: Learner  # the policy, its optimizer and loss: what a step updates (`grpo_trainer.step`)
    order: PromptOrder
    state: checkpoint.TrainState
    generator: Generator | None = None  # rank 0 only
    reporter: ProgressReporter | None = None  # rank 0 only
    saver: checkpoint.Saver | None = None
    evaluator: Evaluator | None = None  # rank 0 only, with spec.dataset.eval: the held-out set
    resumed: checkpoint.Resumed | None = None  # the save this run started from
    pusher: WeightPusher | None = None  # the weights to the rollout servers (every rank)

    @property
    def device(self) -> torch.device:
        return self.learner.device

    @property
    def model(self) -> nn.Module:
        return self.learner.model


def setup(contract: RunContract, info: RankInfo) -> Run:
    spec, algo = contract.spec, contract.spec.algorithm
    check_inputs(contract, info)  # model and checkpoint folders: the field and the reason, before the GPU
    # rank 0 renders every prompt as the servers will, before the GPU: a row that cannot be fails here
    cache = spec.storage.cache_dir  # s3:// models: fetched once per pod into this emptyDir
    check = prompts.Checker(spec, storage.model_dir(spec.model.path, cache)) if info.is_main else None
    rows = load_rows(spec.dataset.path, RowShape.of(spec.dataset))
    order = PromptOrder(check(DATASET_FIELD, rows) if check else rows, spec.dataset.shuffle_seed)
    evaluator = Evaluator.for_dataset(spec.dataset, algo, check) if info.is_main else None
    token = job_token() if info.is_main else ""
    torch.manual_seed(algo.seed)
    device = init_distributed(info, contract)
    memory.check(contract, info, device)  # refuse a job that cannot fit before loading weights
    # a resumeFrom that names no save fails here, before any weights are read
    saves = checkpoint.find_saves(contract.checkpoint_dir, spec.checkpoint.resume_from, info, device)
    groups = make_groups(info)
    backend = str(spec.trainer.ep_backend)
    sharding = spec.trainer.sharding
    load = dict(cache_dir=cache, sharding=sharding)  # each rank reads only its part
    # tokens one MoE layer dispatches at once: what `auto` measures with and DeepEP's buffers hold
    load["ep_tokens"] = ep_tokens_per_dispatch(
        algo.micro_batch_size, algo.max_tokens_per_micro_batch, algo.max_new_tokens
    )
    ac = spec.trainer.activation_checkpointing
    model = load_policy(spec.model.path, groups, backend, device, activation_checkpointing=ac, **load)
    ref = None
    if algo.kl_coef > 0:  # the reference replays the rollout's routing too
        ref_path = spec.model.reference_path or spec.model.path
        ref = load_policy(ref_path, groups, backend, device, activation_checkpointing=False, **load)
        ref.eval().requires_grad_(False)
    offload = str(spec.trainer.optimizer_offload)  # cpu: AdamW state in host memory (DeepSpeed CPU Adam)
    optimizer = GangAdamW(model, groups, lr=algo.learning_rate, sharding=sharding, offload=offload)
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    learner = Learner(
        algo=algo, info=info, groups=groups, device=device, dtype=str(spec.model.dtype), model=model,
        ref=ref, optimizer=optimizer, loss_cfg=LossConfig.from_spec(algo), pad_id=pad_id,
    )  # fmt: skip
    run = Run(contract=contract, info=info, learner=learner, order=order, state=checkpoint.TrainState())
    checkpoint.check_root(contract.checkpoint_dir, info)  # fail at once when this rank cannot save
    run.saver = checkpoint.Saver(
        contract.checkpoint_dir,
        info,
        dist.new_group(backend="gloo"),  # sealing runs beside training: its own (CPU) group
        keep_last=spec.checkpoint.keep_last,
        spec=spec.wire(),
    )
    run.resumed = checkpoint.resume(
        contract.checkpoint_dir, spec.checkpoint.resume_from, model, optimizer, info, device, saves
    )
    if run.resumed is not None:
        run.state = run.resumed.state
    if info.is_main:
        streams = weight_sync.transport(contract) == "collective"
        run.generator = Generator.for_contract(contract, token, streams=streams)  # follows the servers live
        run.reporter = ProgressReporter.from_env(contract)
        run.reporter.attempt_started(run.resumed.state.step if run.resumed else None,
                                     run.resumed.path if run.resumed else None)  # fmt: skip
        run.evaluator = evaluator
    run.pusher = WeightPusher(contract, info, model, device, run.generator)
    run.state.version = run.pusher.sync_at_start(run.state.version, resumed=run.resumed is not None)
    return run


def next_rollouts(run: Run, pending: deque[Prefetch]) -> Rollouts:
    """Rank 0: this step's rollouts, keeping the next `maxStaleness` draws in flight.

    The data is drawn in batches of promptsPerStep prompts, in position order; `pending` holds
    the futures of the draws after the ones taken so far. A draw j places ahead is submitted
    while the servers hold version v (= this step's) and trained at v + j at the latest (every
    step takes at least one draw): j <= maxStaleness is exactly the bound. With dynamicSampling a
    step takes further draws until promptsPerStep of its groups have unequal rewards (at most
    maxDynamicSamplingDraws more); `Rollouts.drawn` says how many prompts it consumed.
    """
    algo, state = run.contract.spec.algorithm, run.state
    n, lag = algo.prompts_per_step, algo.max_staleness
    limit = 1 + (algo.max_dynamic_sampling_draws if algo.dynamic_sampling else 0)
    taken: list[Rollouts] = []
    while True:
        if not pending:
            pending.append(submit_draw(run, state.position + len(taken) * n, ahead=0))
        taken.append(await_draw(run, pending.popleft()))
        if not algo.dynamic_sampling:
            rollouts = taken[0]
            break
        rollouts, full = effective_prefix(Rollouts.concat(taken), n, algo)
        if full or len(taken) == limit:
            break
    consumed = state.position + len(taken) * n
    for j in range(len(pending) + 1, lag + 1):
        if state.step + j >= algo.max_steps:
            break
        pending.append(submit_draw(run, consumed + (j - 1) * n, ahead=j))
    return rollouts


def receive_rollouts(run: Run, pending: deque[Prefetch]) -> Rollouts:
    """Collective: this step's rollouts, from rank 0 (`next_rollouts`). While it waits for them,
    rank 0 may first call every rank to stream the live weights to servers behind them (see
    `await_draw`): the other ranks take such calls until the rollouts come."""
    if run.info.is_main:
        mine = next_rollouts(run, pending).to_bytes()
        broadcast_json({"rollouts": len(mine)}, run.device)
        return Rollouts.from_bytes(broadcast_bytes(mine, run.device))
    while "catch_up" in (call := broadcast_json(None, run.device)):
        run.pusher.catch_up(call["catch_up"], run.state.version)
    return Rollouts.from_bytes(broadcast_bytes(None, run.device))


def await_draw(run: Run, draw: Prefetch) -> Rollouts:
    """Rank 0: a draw's rollouts. A server that came up behind the live weights meanwhile (a
    replacement starts from the model on disk) would refuse the draw's prompts; under the
    collective transport only a stream brings it up to date, so rank 0 calls every rank to one
    (`WeightPusher.catch_up`) and waits on: a lost server costs a catch-up, never the gang."""
    assert run.generator is not None
    while True:
        try:
            return draw.result(timeout=CATCH_UP_POLL_S)
        except TimeoutError:
            pass
        if behind := run.generator.behind():
            assert run.pusher is not None
            broadcast_json({"catch_up": behind}, run.device)
            run.pusher.catch_up(behind, run.state.version)


def submit_draw(run: Run, position: int, *, ahead: int) -> Prefetch:
    """Start generating the promptsPerStep prompts from `position`, to be trained at most `ahead`
    steps from now (servers older than the staleness bound refuse). Its sampling seed is its
    draw number, the same after a resume (draws start at multiples of promptsPerStep)."""
    algo, state, gen = run.contract.spec.algorithm, run.state, run.generator
    assert gen is not None
    n = algo.prompts_per_step
    rows = run.order.take(position, n)
    return gen.submit(rows, step=position // n, min_version=state.version + ahead - algo.max_staleness)


def train(contract: RunContract, info: RankInfo) -> bool:
    """Set up, train, export the policy; False when a signal stopped training early."""
    run = setup(contract, info)
    try:
        finished = loop(run)
        if finished:
            export(run, checkpoint.FINAL_DIR)
    except Exception as e:  # say where before the traceback: pod, rank and step
        log.error("rank %d (pod %d) failed at step %d: %s", info.rank, info.pod_index, run.state.step + 1, e)
        raise
    finally:
        if run.generator is not None:
            run.generator.close()
        if run.reporter is not None:
            run.reporter.close()
    dist.barrier()  # before destroy: avoids gloo aborting peers still in flight
    dist.destroy_process_group()
    return finished


def export(run: Run, name: str) -> None:
    """Collective: every rank writes its part of the policy in HF format, in the weights dtype,
    under checkpointDir/name (`checkpoint.export_hf`; a complete export there is kept)."""
    dest = storage.join(run.contract.checkpoint_dir, name)
    dtype = getattr(torch, str(run.contract.spec.model.dtype))
    done = checkpoint.export_hf(
        run.model, dest, dtype=dtype, tokenizer_from=run.model.config._name_or_path, device=run.device
    )
    if run.info.is_main:
        log.info("policy at step %d %s %s in %.2fs", run.state.step,
                 "already exported to" if done.skipped else "exported to", dest, done.seconds)  # fmt: skip


def save(run: Run, *, wait: bool) -> None:
    """Start this step's save (every rank writes its shards in the background); `wait`: until sealed."""
    assert run.saver is not None
    run.saver.save(run.state, checkpoint.gang_state(run.model, run.learner.optimizer, run.info))
    if wait:
        run.saver.wait()


def loop(run: Run) -> bool:
    """Train to maxSteps; False when stopped early by a signal (after saving a checkpoint)."""
    algo, ckpt = run.contract.spec.algorithm, run.contract.spec.checkpoint
    every, exports = ckpt.every_steps, ckpt.export_every_steps
    stop = StopRequest()
    pending: deque[Prefetch] = deque()
    warning = "; ".join(run.resumed.warnings) if run.resumed and run.resumed.warnings else None
    if run.evaluator is not None and run.state.step == 0:  # the baseline, reported with step 1
        run.evaluator.evaluate(run.generator, step=0, version=run.state.version)
    while run.state.step < algo.max_steps:
        t0 = time.time()
        rollouts = receive_rollouts(run, pending)
        t_gen = time.time()
        stats = run.learner.train_step(rollouts)
        staleness = run.state.version - rollouts.weight_version
        run.state = checkpoint.TrainState(
            step=run.state.step + 1,
            version=run.state.version + 1,
            position=run.state.position + rollouts.prompts_drawn,
        )
        t_train = time.time()
        run.pusher.push(run.state.version)
        t_push = time.time()
        stopping = stop.agreed(run.device)
        last = run.state.step == algo.max_steps
        if run.state.step % every == 0 or last or stopping:
            save(run, wait=last or stopping)  # the last save is waited for: the process ends after it
        if exports and run.state.step % exports == 0:
            export(run, f"{checkpoint.EXPORT_DIR}/{checkpoint.step_name(run.state.step)}")
        if run.reporter is not None:
            ref = run.learner.ref
            ep_s = moe.exchange_seconds(run.model) + (moe.exchange_seconds(ref) if ref else 0.0)
            seconds = StepSeconds(
                step=time.time() - t0,
                rollout=t_gen - t0,
                train=t_train - t_gen,
                push=t_push - t_train,
                ep_all_to_all=ep_s if run.learner.groups.ep is not None else None,
            )
            evaluate = run.evaluator is not None and run.evaluator.due(run.state.step, algo.max_steps)
            if evaluate and not stopping:  # a stop request leaves at once; the last saved step is there
                run.evaluator.evaluate(run.generator, step=run.state.step, version=run.state.version)
            report = step_report(
                run.state,
                rollouts,
                max_steps=algo.max_steps,
                staleness=staleness,
                seconds=seconds,
                metrics=stats,
                untrained_reason=None if stats.get("trained_samples") else untrained_reason(rollouts, algo),
                checkpoint=run.saver.last if run.saver else None,
                resumed_from_step=run.resumed.state.step if run.resumed else None,
                resumed_from=run.resumed.path if run.resumed else None,
                checkpoint_warning=warning,
                evals=run.evaluator.take() if run.evaluator is not None else [],
            )
            run.reporter.report(report)
            warning = None  # said once; the log keeps it
        if stopping:
            return False
    return True
