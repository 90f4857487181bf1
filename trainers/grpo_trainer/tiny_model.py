"""Build the demo's tiny Qwen3-MoE model, char-level tokenizer and addition dataset, offline.

Run as `python -m grpo_trainer.tiny_model DIR` (what `grpo-operator tiny-model DIR` spawns, so the
operator package never imports torch). DIR becomes a Hugging Face model directory (config,
safetensors, tokenizer with a small chat template of its own, `CHAT_TEMPLATE`) that both the trainer
and the rollout servers load, plus `DIR/addition.jsonl`: single-digit sums, {"prompt": "3+4=",
"answer": "7"}, which the rollout's built-in `exact_match` / `math` rewards score; and the same 100
sums split in two as chat messages ({"prompt": [{"role": "user", "content": "3+4="}], "answer":
"7"}), 80 to train on (`addition-train.jsonl`) and 20 held out from RL (`addition-heldout.jsonl`,
what the demo's `dataset.eval` scores; the warm-up below, which teaches the answer format, saw all
100). Both forms reach the model the same way: through the chat template, a string as one user turn.
The model ends its turn with `<|end|>`, which its generation config lists as an end-of-sequence token.

A short supervised warm-up teaches the answer format and a little arithmetic, stopping once
sampled accuracy at temperature 1 reaches `target_accuracy`: RL then starts with signal
(reward clearly above 0) and plenty of room (far from 1). Everything is seeded: the same
seed gives the same files on the same machine.

`save_untrained(DIR, TinyConfig(...))` writes the same kind of directory without the warm-up or the
dataset (random weights, any size, `qwen2` or tied embeddings too): what the tests and the GPU
benchmarks load when they check mechanics (sampling, log-probs, weight sync, export), not answers.

`save_reward_classifier(DIR, TinyConfig(...))` (`--reward-classifier`) writes a tiny sequence-classification
reward model instead (a dense Qwen2 with one output, num_labels 1, over the same tokenizer and chat
template, random weights): what spec.reward.model (kind classifier) serves in tests and the local demo.
The tiny policy itself can serve as a generative judge (kind generative).
"""

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2ForSequenceClassification,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

DATASET_FILE = "addition.jsonl"
TRAIN_FILE, HELDOUT_FILE = "addition-train.jsonl", "addition-heldout.jsonl"
HELDOUT_EVERY = 5  # every fifth sum is held out: 20 of 100, spread over every first digit
SPECIALS = ("<pad>", "<eos>", "<unk>")
# Chat markers, one token each, so a templated prompt stays short for a tiny model.
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|tool|>")
END_OF_TURN = "<|end|>"
# The model's own chat template (what tokenizer_config.json carries): each turn is its role's token,
# its content and END_OF_TURN; the generation prompt opens the assistant's turn.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>' + (m['content'] or '') + '<|end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


@dataclass(frozen=True)
class TinyConfig:
    """Size of the tiny model and length of its warm-up."""

    arch: str = "qwen3_moe"  # or "qwen2": dense (the expert fields unused), for tests without MoE
    hidden: int = 64  # model width; the dense MLPs are twice that
    layers: int = 2  # decoder layers (qwen3_moe: every one an MoE layer)
    experts: int = 8  # routed experts per layer
    top_k: int = 2  # experts per token
    expert_width: int = 64  # moe_intermediate_size
    heads: int = 4  # attention heads
    kv_heads: int = 2  # key/value heads (grouped-query attention)
    head_dim: int = 16  # attention head width (qwen3_moe); vLLM's CPU attention needs 32, 64, ... (not 16)
    max_positions: int = 256  # max_position_embeddings
    tied: bool = False  # lm_head is the input embedding; the demo's is separate (no tie for EP or sync)
    seed: int = 0  # seeds init, warm-up batches and the accuracy probe
    max_warmup_steps: int = 400  # upper bound on supervised steps
    target_accuracy: float = 0.3  # stop the warm-up at this sampled accuracy (temperature 1)
    lr: float = 3e-3  # warm-up AdamW learning rate


def build_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character of printable ASCII (plus newline and tab): no merges to learn, and
    every digit is its own token, which keeps the arithmetic task legible to a tiny model; the chat
    markers are special tokens of their own, rendered by `CHAT_TEMPLATE`."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for c in [chr(i) for i in range(32, 127)] + ["\n", "\t"]:
        vocab[c] = len(vocab)
    for marker in (*ROLE_TOKENS, END_OF_TURN):
        vocab[marker] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=[*ROLE_TOKENS, END_OF_TURN],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def end_ids(tokenizer: PreTrainedTokenizerFast) -> list[int]:
    """The tokens that end a completion: EOS and the end of the assistant's turn."""
    return [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(END_OF_TURN)]


def build_model(cfg: TinyConfig, tokenizer: PreTrainedTokenizerFast) -> PreTrainedModel:
    """A random causal LM of `cfg`'s size over `tokenizer`'s vocabulary, seeded by `cfg.seed`. Its
    generation config carries EOS and pad (what `generate()` and vLLM stop and pad with) as set
    here, not as transformers would derive them from the model config."""
    torch.manual_seed(cfg.seed)
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden,
        intermediate_size=2 * cfg.hidden,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=cfg.max_positions,
        tie_word_embeddings=cfg.tied,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    model: PreTrainedModel
    if cfg.arch == "qwen3_moe":
        model = Qwen3MoeForCausalLM(
            Qwen3MoeConfig(
                moe_intermediate_size=cfg.expert_width,
                head_dim=cfg.head_dim,
                num_experts=cfg.experts,
                num_experts_per_tok=cfg.top_k,
                **common,
            )
        )
    elif cfg.arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        raise ValueError(f"unknown tiny arch {cfg.arch!r}; choose qwen3_moe or qwen2")
    model.generation_config = GenerationConfig(
        eos_token_id=end_ids(tokenizer), pad_token_id=tokenizer.pad_token_id
    )
    return model


def save_untrained(out: Path, cfg: TinyConfig, dtype: torch.dtype = torch.float32) -> Path:
    """Write `build_model(cfg)`'s random weights (in `dtype`) and the tokenizer to `out`: a model
    directory for checking mechanics, without the warm-up or the dataset of `build`."""
    tok = build_tokenizer()
    build_model(cfg, tok).to(dtype).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def build_reward_classifier(cfg: TinyConfig, tokenizer: PreTrainedTokenizerFast) -> PreTrainedModel:
    """A random dense Qwen2 sequence classifier with one output (the score) over `tokenizer`'s
    vocabulary; pad_token_id set, so batches of any length find each row's last token."""
    torch.manual_seed(cfg.seed)
    return Qwen2ForSequenceClassification(
        Qwen2Config(
            vocab_size=len(tokenizer),
            hidden_size=cfg.hidden,
            intermediate_size=2 * cfg.hidden,
            num_hidden_layers=cfg.layers,
            num_attention_heads=cfg.heads,
            num_key_value_heads=cfg.kv_heads,
            max_position_embeddings=cfg.max_positions,
            num_labels=1,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=None,
        )
    )


def save_reward_classifier(out: Path, cfg: TinyConfig, dtype: torch.dtype = torch.float32) -> Path:
    """Write `build_reward_classifier(cfg)` and the tokenizer to `out` (a reward model directory)."""
    tok = build_tokenizer()
    build_reward_classifier(cfg, tok).to(dtype).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def addition_rows() -> list[dict[str, str]]:
    return [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(10)]


def as_chat(row: dict[str, str]) -> dict[str, object]:
    """The row with its prompt as one user message (the conversational form)."""
    return {**row, "prompt": [{"role": "user", "content": row["prompt"]}]}


def templated(tok: PreTrainedTokenizerFast, prompt: str) -> list[int]:
    """`prompt` as one user turn through the chat template, as the rollout servers render it."""
    text = tok.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )
    return tok(text, add_special_tokens=False).input_ids


def sampled_accuracy(
    model: PreTrainedModel, tok: PreTrainedTokenizerFast, rows: list[dict], seed: int
) -> float:
    """Fraction of exact answers when sampling at temperature 1 (what RL starts from)."""
    ids = torch.tensor([templated(tok, r["prompt"]) for r in rows])  # [N, P]: every prompt is P tokens
    width = ids.shape[1]
    gen = torch.Generator().manual_seed(seed)
    model.eval()
    with torch.no_grad():
        for _ in range(3):  # answers are at most 2 digits + end of turn
            logits = model(ids).logits[:, -1]  # [N, V]
            nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)
            ids = torch.cat([ids, nxt], dim=1)
    model.train()
    answers = tok.batch_decode(ids[:, width:], skip_special_tokens=False)
    good = sum(a.split(END_OF_TURN)[0] == r["answer"] for a, r in zip(answers, rows, strict=True))
    return good / len(rows)


def warm_up(model: PreTrainedModel, tok: PreTrainedTokenizerFast, cfg: TinyConfig) -> tuple[int, float]:
    """Supervised steps on templated prompt + answer + end of turn (loss on the answer tokens only)
    until the target accuracy."""
    rows = addition_rows()
    end = tok.convert_tokens_to_ids(END_OF_TURN)
    prompts = [templated(tok, r["prompt"]) for r in rows]
    seqs = [[*p, *tok(r["answer"]).input_ids, end] for p, r in zip(prompts, rows, strict=True)]
    width = max(len(s) for s in seqs)
    ids = torch.tensor([s + [tok.pad_token_id] * (width - len(s)) for s in seqs])  # [100, P + 3]
    labels = ids.clone()
    labels[:, : len(prompts[0])] = -100  # no loss on the prompt
    labels[ids == tok.pad_token_id] = -100
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(cfg.seed)
    acc = sampled_accuracy(model, tok, rows, cfg.seed)
    step = 0
    while step < cfg.max_warmup_steps and acc < cfg.target_accuracy:
        batch = torch.randperm(len(rows), generator=gen)[:32]
        loss = model(ids[batch], labels=labels[batch]).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        if step % 10 == 0:
            acc = sampled_accuracy(model, tok, rows, cfg.seed + step)
    return step, acc


WarmUp = Callable[[PreTrainedModel, PreTrainedTokenizerFast, TinyConfig], tuple[int, float]]


def save_warmed(out: Path, cfg: TinyConfig, warm: WarmUp) -> tuple[PreTrainedModel, int, float]:
    """Build the model, warm it up with `warm` (-> steps, accuracy) and save it with its tokenizer."""
    torch.manual_seed(cfg.seed)
    tok = build_tokenizer()
    model = build_model(cfg, tok)
    steps, acc = warm(model, tok, cfg)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return model, steps, acc


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)


def build(out: Path, cfg: TinyConfig) -> dict[str, float | int | str]:
    """Write model, tokenizer and dataset to `out`; return a summary for the console."""
    model, steps, acc = save_warmed(out, cfg, warm_up)
    rows = addition_rows()
    heldout = [r for i, r in enumerate(rows) if i % HELDOUT_EVERY == HELDOUT_EVERY // 2]
    for name, part in (
        (DATASET_FILE, rows),
        (TRAIN_FILE, [as_chat(r) for r in rows if r not in heldout]),
        (HELDOUT_FILE, [as_chat(r) for r in heldout]),
    ):
        write_jsonl(out / name, part)
    params = sum(p.numel() for p in model.parameters())
    return {"dir": str(out), "parameters": params, "warmup_steps": steps, "sampled_accuracy": acc}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m grpo_trainer.tiny_model", description=__doc__.splitlines()[0]
    )
    parser.add_argument("dir", type=Path, help="output directory (created)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--experts", type=int, default=TinyConfig.experts)
    parser.add_argument("--target-accuracy", type=float, default=TinyConfig.target_accuracy)
    parser.add_argument("--head-dim", type=int, default=TinyConfig.head_dim)
    parser.add_argument(
        "--reward-classifier", action="store_true", help="write a tiny reward classifier instead"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.reward_classifier:
        out = save_reward_classifier(args.dir, TinyConfig(seed=args.seed))
        print(json.dumps({"dir": str(out), "kind": "classifier", "num_labels": 1}))
        return 0
    cfg = TinyConfig(
        seed=args.seed, experts=args.experts, target_accuracy=args.target_accuracy, head_dim=args.head_dim
    )
    print(json.dumps(build(args.dir, cfg)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
