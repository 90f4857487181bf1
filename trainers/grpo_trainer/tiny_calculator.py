"""The tiny model for a task it cannot do in its head: powers, with a calculator.

Run as `python -m grpo_trainer.tiny_calculator DIR` (what `grpo-operator tiny-model DIR --task
calculator` spawns). DIR gets the demo's tiny model (`grpo_trainer.tiny_model`: char tokenizer, its
chat template) warmed up on calculator episodes, and `powers.jsonl`: {"prompt": [{"role": "user",
"content": "7^5="}], "answer": "16807"} for bases 2-9 and exponents 2-5. A five-digit power is not
something a 0.2M-parameter character model computes; what it can learn is to copy the two digits
into a call

    <tool_call>{"name": "calculator", "arguments": {"expression": "7**5"}}</tool_call>

and the calculator's result into its answer. The warm-up teaches the format, stopping when greedy
episodes with the real calculator answer `target_accuracy` of the prompts: RL
(`examples/tiny-local-calculator.yaml`) then has signal and room. Episodes are laid out exactly as
the rollout servers lay them out (the model's chat template, the tool message masked out of the
loss), so what is warmed up is what RL samples from.
"""

import argparse
import json
import sys
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from grpo_trainer.tiny_model import END_OF_TURN, TinyConfig, save_warmed, templated, write_jsonl

DATASET_FILE = "powers.jsonl"


def pairs() -> list[tuple[int, int]]:
    return [(a, b) for a in range(2, 10) for b in range(2, 6)]


def question(a: int, b: int) -> str:
    return f"{a}^{b}="


def call_text(a: int, b: int) -> str:
    return f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{a}**{b}"}}}}</tool_call>'


def episode(tok: PreTrainedTokenizerFast, a: int, b: int) -> tuple[list[int], list[int]]:
    """One correct episode's tokens and its loss mask (1 on the model's turns): the prompt, the call,
    the calculator's result as a tool message, the answer; as the rollout servers lay them out."""
    prompt = templated(tok, question(a, b))
    end = tok.convert_tokens_to_ids(END_OF_TURN)
    call = [*tok(call_text(a, b), add_special_tokens=False).input_ids, end]
    tool = tok(f"<|tool|>{a**b}<|end|><|assistant|>", add_special_tokens=False).input_ids
    answer = [*tok(str(a**b), add_special_tokens=False).input_ids, end]
    ids = prompt + call + tool + answer
    mask = [0] * len(prompt) + [1] * len(call) + [0] * len(tool) + [1] * len(answer)
    return ids, mask


def sample(
    model: PreTrainedModel, ids: list[int], end: int, gen: torch.Generator, limit: int = 100
) -> list[int]:
    """Tokens sampled at temperature 1 (what RL starts from) until `end` or `limit`."""
    out: list[int] = []
    with torch.no_grad():
        for _ in range(limit):
            probs = torch.softmax(model(torch.tensor([ids + out])).logits[0, -1], -1)
            nxt = int(torch.multinomial(probs, 1, generator=gen))
            out.append(nxt)
            if nxt == end:
                break
    return out


def accuracy(model: PreTrainedModel, tok: PreTrainedTokenizerFast, seed: int) -> float:
    """Share of sampled episodes (temperature 1) that call the calculator with the right numbers and
    answer with its result (fed back as the tool message the servers would append)."""
    end = tok.convert_tokens_to_ids(END_OF_TURN)
    gen = torch.Generator().manual_seed(seed)
    model.eval()
    good = 0
    for a, b in pairs():
        prompt = templated(tok, question(a, b))
        call = tok.decode(sample(model, prompt, end, gen), skip_special_tokens=True)
        if call != call_text(a, b):
            continue
        ids, _ = episode(tok, a, b)
        answer_at = len(ids) - len(str(a**b)) - 1
        good += tok.decode(sample(model, ids[:answer_at], end, gen, 8), skip_special_tokens=True) == str(a**b)
    model.train()
    return good / len(pairs())


def warm_up(model: PreTrainedModel, tok: PreTrainedTokenizerFast, cfg: TinyConfig) -> tuple[int, float]:
    seqs = [episode(tok, a, b) for a, b in pairs()]
    width = max(len(s) for s, _ in seqs)
    ids = torch.tensor([s + [tok.pad_token_id] * (width - len(s)) for s, _ in seqs])
    labels = torch.tensor([[t if m else -100 for t, m in zip(s, k, strict=True)] + [-100] * (width - len(s))
                           for s, k in seqs])  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(cfg.seed)
    acc, step = 0.0, 0
    while step < cfg.max_warmup_steps and acc < cfg.target_accuracy:
        batch = torch.randperm(len(seqs), generator=gen)[:32]
        loss = model(ids[batch], labels=labels[batch]).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        if step % 25 == 0:
            acc = accuracy(model, tok, cfg.seed + step)
    return step, acc


def build(out: Path, cfg: TinyConfig) -> dict[str, float | int | str]:
    _, steps, acc = save_warmed(out, cfg, warm_up)
    rows = [
        {"prompt": [{"role": "user", "content": question(a, b)}], "answer": str(a**b)} for a, b in pairs()
    ]
    write_jsonl(out / DATASET_FILE, rows)
    return {"dir": str(out), "warmup_steps": steps, "sampled_accuracy": acc}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m grpo_trainer.tiny_calculator", description=__doc__.splitlines()[0]
    )
    parser.add_argument("dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target-accuracy", type=float, default=0.3)
    parser.add_argument("--head-dim", type=int, default=TinyConfig.head_dim)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    cfg = TinyConfig(
        seed=args.seed,
        target_accuracy=args.target_accuracy,
        head_dim=args.head_dim,
        max_warmup_steps=1500,
        max_positions=256,
    )
    print(json.dumps(build(args.dir, cfg)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
