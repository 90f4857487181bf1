"""Dataset reader (errors as FILE:LINE) and the deterministic, resumable prompt order."""

import re
from pathlib import Path

import pytest
from grpo_operator.api.status import Reason
from grpo_trainer.config import ConfigError
from grpo_trainer.data import PromptOrder, RowShape, load_rows, lookup


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "data.jsonl"
    path.write_text(text)
    return path


def test_rows_keep_other_columns_and_line_numbers(tmp_path: Path) -> None:
    path = write(tmp_path, '{"prompt": "1+1=", "answer": "2"}\n\n{"prompt": "2+2=", "answer": "4"}\n')
    rows = load_rows(path)
    assert [(r.prompt, r.columns, r.line) for r in rows] == [
        ("1+1=", {"answer": "2"}, 1),
        ("2+2=", {"answer": "4"}, 3),
    ]


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ('{"prompt": "1+1=", ', "not valid JSON"),
        ('["1+1="]', "expected a JSON object, got list"),
        ('{"question": "1+1="}', "field 'prompt' missing"),
        ('{"prompt": 7}', "field 'prompt' missing or not a non-empty string"),
        ('{"prompt": []}', "field 'prompt' is an empty message list"),
        (
            '{"prompt": [{"role": "robot", "content": "hi"}]}',
            r"field 'prompt'\[0\].role 'robot' is not one of",
        ),
        ('{"prompt": [{"role": "user", "content": "a"}, "b"]}', r"field 'prompt'\[1\] is a str"),
        ('{"prompt": [{"role": "user", "content": 3}]}', r"field 'prompt'\[0\].content must be a string"),
    ],
)
def test_bad_row_is_reported_by_file_and_line(tmp_path: Path, line: str, reason: str) -> None:
    path = write(tmp_path, '{"prompt": "a"}\n{"prompt": "b"}\n' + line + "\n")
    with pytest.raises(ConfigError, match=f"^spec.dataset.path {path}:3: {reason}"):
        load_rows(path)


def test_custom_prompt_field(tmp_path: Path) -> None:
    rows = load_rows(
        write(tmp_path, '{"question": "q", "prompt": "kept as a column"}\n'), RowShape("question")
    )
    assert rows[0].prompt == "q" and rows[0].columns == {"prompt": "kept as a column"}


def test_missing_and_empty_files_are_config_errors_naming_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=f"^spec.dataset.path {tmp_path}/nope.jsonl: does not exist") as e:
        load_rows(tmp_path / "nope.jsonl")
    assert e.value.reason == Reason.PATH_NOT_FOUND
    with pytest.raises(ConfigError, match=r"^spec\.dataset\.eval\.path .*: is an empty file") as e:
        load_rows(write(tmp_path, ""), field="spec.dataset.eval.path")
    assert e.value.reason == Reason.DATASET_EMPTY
    with pytest.raises(ConfigError, match=r"^spec\.dataset\.path .*: the dataset has no rows") as e:
        load_rows(write(tmp_path, "\n\n"))  # bytes, but no usable row
    assert e.value.reason == Reason.DATASET_EMPTY
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "notes.txt").write_text("x")
    with pytest.raises(ConfigError, match=r"is a folder with no \.jsonl") as e:
        load_rows(tmp_path / "d")
    assert e.value.reason == Reason.PATH_WRONG_KIND


def rows(n: int, tmp_path: Path) -> list:
    return load_rows(write(tmp_path, "".join(f'{{"prompt": "p{i}"}}\n' for i in range(n))))


def test_each_epoch_is_a_permutation_and_epochs_differ(tmp_path: Path) -> None:
    order = PromptOrder(rows(10, tmp_path), seed=3)
    epoch0 = [order.at(p).prompt for p in range(10)]
    epoch1 = [order.at(p).prompt for p in range(10, 20)]
    assert sorted(epoch0) == sorted(epoch1) == sorted(f"p{i}" for i in range(10))
    assert epoch0 != epoch1


def test_order_is_a_pure_function_of_position(tmp_path: Path) -> None:
    data = rows(7, tmp_path)
    straight = [r.prompt for _, r in PromptOrder(data, seed=1).take(0, 20)]
    # a resumed run starting at position 13 sees exactly the continuation: nothing skipped or repeated
    resumed = PromptOrder(data, seed=1)
    assert [r.prompt for _, r in resumed.take(0, 13)] + [r.prompt for _, r in resumed.take(13, 7)] == straight
    assert [p for p, _ in resumed.take(13, 3)] == [13, 14, 15]
    assert [r.prompt for _, r in PromptOrder(data, seed=2).take(0, 20)] != straight


def write_parquet(path: Path, rows: list[dict], row_group_size: int = 2) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)
    return path


def test_parquet_rows_across_row_groups_keep_columns_and_row_numbers(tmp_path: Path) -> None:
    data = [{"prompt": f"{i}+1=", "answer": str(i + 1), "level": i % 3} for i in range(5)]
    rows = load_rows(write_parquet(tmp_path / "d.parquet", data))  # three row groups
    assert [(r.prompt, r.columns, r.line) for r in rows] == [
        (d["prompt"], {"answer": d["answer"], "level": d["level"]}, i + 1) for i, d in enumerate(data)
    ]


def test_bad_parquet_row_is_reported_by_file_and_row(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "d.parquet", [{"prompt": "a"}, {"prompt": "b"}, {"prompt": ""}])
    expected = f"^spec.dataset.path {re.escape(str(path))}: row 3: field 'prompt' missing or not a non-empty"
    with pytest.raises(ConfigError, match=expected):
        load_rows(path)
    other = write_parquet(tmp_path / "q.parquet", [{"question": "a", "answer": "1"}])
    with pytest.raises(ConfigError, match=r"no column 'prompt' \(columns: question, answer\)"):
        load_rows(other)
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(ConfigError, match="not a readable Parquet file"):
        load_rows(tmp_path / "broken.parquet")


def test_a_folder_reads_its_data_files_in_name_order(tmp_path: Path) -> None:
    folder = tmp_path / "ds"
    folder.mkdir()
    write_parquet(folder / "b.parquet", [{"prompt": "from parquet"}])
    (folder / "a.jsonl").write_text('{"prompt": "from jsonl"}\n')
    (folder / "README.md").write_text("not data")
    assert [r.prompt for r in load_rows(folder)] == ["from jsonl", "from parquet"]
    (folder / "c.jsonl").write_text('{"prompt": 1}\n')
    with pytest.raises(ConfigError, match=f"^spec.dataset.path {folder}/c.jsonl:1: field 'prompt'"):
        load_rows(folder)


def test_verl_prepared_parquet_loads_as_it_is_with_the_answer_mapped_from_its_nested_column(
    tmp_path: Path,
) -> None:
    """The shape verl's preprocess scripts write (DAPO-Math-17k, GSM8K): `prompt` a list of chat
    messages, the answer in `reward_model.ground_truth`, nested structs in Parquet."""
    data = [
        {
            "data_source": "math_dapo",
            "prompt": [{"role": "user", "content": f"What is {i}+1?"}],
            "ability": "MATH",
            "reward_model": {"ground_truth": str(i + 1), "style": "rule-math"},
            "extra_info": {"index": i, "split": "train"},
        }
        for i in range(3)
    ]
    shape = RowShape(columns=(("answer", "reward_model.ground_truth"), ("index", "extra_info.index")))
    rows = load_rows(write_parquet(tmp_path / "dapo.parquet", data), shape)
    assert rows[2].prompt == [{"role": "user", "content": "What is 2+1?"}]
    assert rows[2].columns["answer"] == "3" and rows[2].columns["index"] == 2
    assert rows[2].columns["reward_model"] == {"ground_truth": "3", "style": "rule-math"}  # kept whole too


def test_trl_conversational_jsonl_with_a_system_turn_loads(tmp_path: Path) -> None:
    line = (
        '{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}], '
        '"completion": [{"role": "assistant", "content": "4"}], "solution": "4"}\n'
    )
    rows = load_rows(write(tmp_path, line), RowShape(columns=(("answer", "solution"),)))
    assert [m["role"] for m in rows[0].prompt] == ["system", "user"]
    assert rows[0].columns["answer"] == "4"


def test_a_row_without_a_mapped_path_names_the_file_the_row_and_the_column(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        '{"prompt": "a", "reward_model": {"ground_truth": "1"}}\n'
        '{"prompt": "b", "reward_model": {"style": "x"}}\n',
    )
    with pytest.raises(ConfigError) as e:
        load_rows(path, RowShape(columns=(("answer", "reward_model.ground_truth"),)))
    assert str(e.value) == (
        f"spec.dataset.path {path}:2: spec.dataset.columns.answer (reward_model.ground_truth): "
        "no 'ground_truth' in reward_model (keys: style)"
    )


def test_dotted_paths_read_keys_and_list_indexes() -> None:
    row = {"a": {"b": [{"c": 1}, {"c": 2}]}, "x.y": 3}
    assert lookup(row, "a.b.1.c") == 2 and lookup(row, "a.b.-1.c") == 2
    with pytest.raises(KeyError, match=r"no '5' in a\.b"):
        lookup(row, "a.b.5.c")
    with pytest.raises(KeyError, match="no 'z' in the row"):
        lookup(row, "z")
