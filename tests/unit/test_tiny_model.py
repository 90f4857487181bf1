"""The tiny demo model: built offline through the operator CLI, reloadable by HF, a usable starting point;
and its untrained variants (`save_untrained`), the models of the tests and GPU benchmarks."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from grpo_trainer.tiny_model import (
    DATASET_FILE,
    HELDOUT_FILE,
    TRAIN_FILE,
    TinyConfig,
    build_model,
    build_tokenizer,
    save_untrained,
)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("tiny") / "model"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "grpo_operator.cli", "tiny-model", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=True,
    )
    return out, json.loads(proc.stdout.strip().splitlines()[-1])


def test_tokenizer_covers_printable_ascii_one_token_per_char() -> None:
    tok = build_tokenizer()
    text = "".join(chr(i) for i in range(32, 127)) + "\n\t"
    ids = tok(text).input_ids
    assert len(ids) == len(text) and tok.unk_token_id not in ids
    assert tok.decode(ids) == text


def test_model_reloads_offline_as_qwen3_moe(built: tuple[Path, dict]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, _ = built
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert model.config.model_type == "qwen3_moe"
    assert model.config.num_experts == 8 and model.config.num_experts_per_tok == 2
    assert tok("7+1=").input_ids == build_tokenizer()("7+1=").input_ids
    logits = model(torch.tensor([tok("7+1=").input_ids])).logits
    assert logits.shape == (1, 4, len(tok))


def test_dataset_is_single_digit_addition_and_the_demo_sets_are_chat_messages(
    built: tuple[Path, dict],
) -> None:
    out, _ = built
    rows = [json.loads(line) for line in (out / DATASET_FILE).read_text().splitlines()]
    assert len(rows) == 100
    assert {"prompt": "3+4=", "answer": "7"} in rows
    assert all(int(r["prompt"][0]) + int(r["prompt"][2]) == int(r["answer"]) for r in rows)
    chats = [
        json.loads(line) for f in (TRAIN_FILE, HELDOUT_FILE) for line in (out / f).read_text().splitlines()
    ]
    assert len(chats) == 100 and {"prompt": [{"role": "user", "content": "3+4="}], "answer": "7"} in chats


def test_the_tokenizer_ships_its_chat_template_and_renders_markers_as_single_tokens(
    built: tuple[Path, dict],
) -> None:
    from transformers import AutoTokenizer

    out, _ = built
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "3+4="}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|user|>3+4=<|end|><|assistant|>"
    assert len(tok(text, add_special_tokens=False).input_ids) == 7


def test_warm_up_leaves_signal_and_room(built: tuple[Path, dict]) -> None:
    _, summary = built
    assert 0.2 <= summary["sampled_accuracy"] <= 0.6
    assert 0 < summary["warmup_steps"] <= 400


@pytest.mark.parametrize(
    ("cfg", "model_type"),
    [
        (TinyConfig(experts=4, expert_width=32, head_dim=32), "qwen3_moe"),
        (TinyConfig(arch="qwen2", tied=True), "qwen2"),
    ],
    ids=["moe", "dense-tied"],
)
def test_an_untrained_variant_reloads_with_its_sizes_and_names_eos_and_pad(
    tmp_path: Path, cfg: TinyConfig, model_type: str
) -> None:
    from transformers import AutoModelForCausalLM, GenerationConfig

    save_untrained(tmp_path, cfg)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True)
    assert model.config.model_type == model_type and model.config.tie_word_embeddings == cfg.tied
    if model_type == "qwen3_moe":
        assert (model.config.num_experts, model.config.head_dim) == (4, 32)
    tok = build_tokenizer()
    generation = GenerationConfig.from_pretrained(tmp_path, local_files_only=True)
    # a completion ends at EOS or at the end of the assistant's turn (what the chat template closes with)
    assert generation.eos_token_id == [tok.eos_token_id, tok.convert_tokens_to_ids("<|end|>")]
    assert generation.pad_token_id == tok.pad_token_id
    assert not (tmp_path / DATASET_FILE).exists()  # no warm-up, no dataset


def test_an_unknown_arch_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown tiny arch 'llama'"):
        build_model(TinyConfig(arch="llama"), build_tokenizer())


@pytest.mark.slow
def test_build_is_deterministic(built: tuple[Path, dict], tmp_path: Path) -> None:
    out, _ = built
    subprocess.run(
        [sys.executable, "-m", "grpo_trainer.tiny_model", str(tmp_path)],
        check=True,
        timeout=300,
        capture_output=True,
    )
    assert (tmp_path / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
