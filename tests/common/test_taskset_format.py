"""Tasksets from the user's own data: each reader on real files, the `columns` format, a
plugin's reader and format, and the one-line error of each kind of bad row."""

from __future__ import annotations

import json
import textwrap

import pytest

from tandem.common.config import TasksetConfig, load_config
from tandem.common.errors import ConfigError
from tandem.common.plugins import TASKSET_FORMATS, TASKSET_READERS, load_plugins
from tandem.common.tasks import load_rows, load_tasks, read_sources

CHAT = [{"role": "user", "content": "What is 2+2?"}]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def tasks(path, key="master.taskset", **cfg):
    """The tasks of `path` under the taskset settings `cfg`, validated as a config would be."""
    ts = TasksetConfig(path=str(path), **cfg)
    return load_tasks(ts.path, ts.split, key=key, reader=ts.reader, format=ts.format,
                      id_field=ts.id_field)


def error_of(path, **cfg) -> str:
    with pytest.raises(ConfigError) as exc:
        tasks(path, **cfg)
    assert len(exc.value.errors) == 1 and "\n" not in exc.value.errors[0]
    return exc.value.errors[0]


# -- readers ----------------------------------------------------------------------------------

def test_jsonl_file_and_folder_in_name_order(tmp_path):
    write_jsonl(tmp_path / "b.jsonl", [{"q": "3"}])
    write_jsonl(tmp_path / "a.jsonl", [{"q": "1"}, {"q": "2"}])
    assert [r["q"] for r in tasks(tmp_path / "a.jsonl")] == ["1", "2"]
    assert [r["q"] for r in tasks(tmp_path)] == ["1", "2", "3"]
    assert [r["q"] for r in tasks(tmp_path, reader="jsonl")] == ["1", "2", "3"]


def test_parquet_keeps_lists_and_structs(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"chat": [CHAT, [{"role": "user", "content": "hi"}]],
                             "gold": ["4", "hello"]}), tmp_path / "t.parquet")
    got = tasks(tmp_path / "t.parquet", format={"messages": "chat", "answer": "gold"})
    assert got == [{"messages": CHAT, "answer": "4"},
                   {"messages": [{"role": "user", "content": "hi"}], "answer": "hello"}]


def test_csv_header_quoted_cells_and_json_cells(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text('\ufeffquestion,truth,chat,tol\n'
                    '"two\nlines",4,"[{""role"": ""user"", ""content"": ""hi""}]",0.5\n'
                    '\n'
                    'plain,5,[],1\n', encoding="utf-8")
    rows = load_rows(str(path))
    assert rows == [{"question": "two\nlines", "truth": "4", "tol": "0.5",
                     "chat": '[{"role": "user", "content": "hi"}]'},
                    {"question": "plain", "truth": "5", "chat": "[]", "tol": "1"}]
    got = tasks(path, format={"prompt": "question", "answer": "truth", "args": {"tol": "tol"}})
    assert got[0] == {"prompt": "two\nlines", "answer": "4", "reward_args": {"tol": "0.5"}}
    # a messages column in a CSV is JSON text, parsed into the list
    one = tmp_path / "one.csv"
    one.write_text('chat\n"[{""role"": ""user"", ""content"": ""hi""}]"\n')
    assert tasks(one, format={"messages": "chat"}) == [
        {"messages": [{"role": "user", "content": "hi"}]}]


def test_a_reader_named_reads_a_file_of_any_suffix(tmp_path):
    (tmp_path / "data.txt").write_text("q,a\n1+1,2\n")
    assert tasks(tmp_path / "data.txt", reader="csv") == [{"q": "1+1", "a": "2"}]
    err = error_of(tmp_path / "data.txt")
    assert err.startswith(f"master.taskset.path: {tmp_path / 'data.txt'} has no known suffix")
    assert "master.taskset.reader" in err


def test_saved_dataset_and_its_splits(tmp_path):
    import datasets

    ds = datasets.Dataset.from_dict({"q": ["a", "b", "c"], "a": ["1", "2", "3"]})
    datasets.DatasetDict({"train": ds, "test": ds.select([2])}).save_to_disk(str(tmp_path / "dd"))
    assert tasks(tmp_path / "dd", split="test", format={"prompt": "q", "answer": "a"}) == [
        {"prompt": "c", "answer": "3"}]
    assert len(tasks(tmp_path / "dd", split="train", reader="datasets")) == 3
    assert "has splits ['test', 'train']; name one" in error_of(tmp_path / "dd")
    [source] = read_sources(str(tmp_path / "dd"), "test")
    assert source.name == f"{tmp_path / 'dd'} (split test)"


def test_hub_reader_goes_through_load_dataset(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    data = tmp_path / "gsm"
    data.mkdir()
    write_jsonl(data / "train.jsonl", [{"question": "1+1", "answer": "2"},
                                       {"question": "2+3", "answer": "5"}])
    got = tasks(data, reader="hub", split="train",
                format={"prompt": "question", "answer": "answer"})
    assert got == [{"prompt": "1+1", "answer": "2"}, {"prompt": "2+3", "answer": "5"}]
    assert len(tasks(data, reader="hub")) == 2  # one split: no need to name it
    err = error_of(data, reader="hub", split="validation")
    assert err.startswith(f"master.taskset.path: datasets.load_dataset({str(data)!r}, "
                          "split='validation') failed: ")


def test_unknown_reader_and_format_name_the_key_and_the_registered(tmp_path):
    write_jsonl(tmp_path / "t.jsonl", [{"q": "1"}])
    err = error_of(tmp_path / "t.jsonl", reader="xml")
    assert err.startswith("master.taskset.reader: unknown taskset reader 'xml'; registered: ")
    # the built-in readers are named (a package imported earlier in the session, such as the
    # explorer's `online` reader, may add its own to the list)
    registered = err.split("registered: ", 1)[1].split(";")[0].split(", ")
    assert {"csv", "datasets", "hub", "jsonl", "parquet"} <= set(registered), err
    err = error_of(tmp_path / "t.jsonl", format={"name": "mine"})
    assert err.startswith("master.taskset.format.name: unknown taskset format 'mine'")
    assert "does not exist (a dataset on the Hugging Face hub: set master.taskset.reader: hub)" \
        in error_of(tmp_path / "missing")


# -- the columns format -----------------------------------------------------------------------

def test_columns_make_the_keys_the_workflows_read(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [
        {"uid": 7, "question": "1+1?", "sys": "Be brief.", "gold": {"type": "short", "v": "2"},
         "params": {"tolerance": 0.1}, "level": "easy", "unused": 1}])
    got = tasks(path, format={"prompt": "question", "system_column": "sys", "answer": "gold",
                              "args": "params", "id": "uid", "keep": ["level"]})
    assert got == [{"prompt": "1+1?", "system": "Be brief.", "answer": {"type": "short", "v": "2"},
                    "reward_args": {"tolerance": 0.1}, "id": "7", "level": "easy"}]


def test_a_system_prompt_leads_the_messages_unless_the_row_has_one(tmp_path):
    own = [{"role": "system", "content": "Mine."}, *CHAT]
    path = write_jsonl(tmp_path / "t.jsonl", [{"chat": CHAT}, {"chat": own}])
    got = tasks(path, format={"messages": "chat", "system": "Think."})
    assert got[0]["messages"] == [{"role": "system", "content": "Think."}, *CHAT]
    assert got[1]["messages"] == own
    assert "system" not in got[0]


def test_id_field_is_the_format_id_and_keeps_the_ids_of_raw_rows(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"k": "a", "q": "1"}, {"k": "b", "q": "2"}])
    cfg = TasksetConfig(path=str(path), id_field="k", format={"prompt": "q"})
    assert cfg.format.id == "k" and cfg.id_key == "id"
    assert [t["id"] for t in tasks(path, id_field="k", format={"prompt": "q"})] == ["a", "b"]
    assert TasksetConfig(path=str(path), id_field="k").id_key == "k"
    assert [t["k"] for t in tasks(path, id_field="k")] == ["a", "b"]  # no format: rows as read


def test_format_settings_are_checked_with_the_config(tmp_path):
    def problems(**fmt):
        with pytest.raises(ConfigError) as exc:
            load_config(None, [f"master.taskset.format={json.dumps(fmt)}",
                               f"master.taskset.path={tmp_path}"])
        return " ".join(exc.value.errors)

    assert "master.taskset.format: prompt and messages are both set" in problems(
        prompt="q", messages="m")
    assert "set prompt (the column of prompt text) or messages" in problems(answer="a")
    assert "system and system_column are both set" in problems(prompt="q", system="s",
                                                               system_column="c")
    assert "keep: 'answer' is a key tandem sets" in problems(prompt="q", keep=["answer"])
    with pytest.raises(ConfigError, match="id_field 'a' and format.id 'b' name different"):
        load_config(None, ["master.taskset.id_field=a", 'master.taskset.format={"prompt": "q", '
                           '"id": "b"}'])


# -- bad rows: one line naming the key, the file, the row and the column ----------------------

@pytest.mark.parametrize("row, fmt, expected", [
    ({"q": "1"}, {"prompt": "question"},
     "master.taskset.format.prompt: {file} row 2: column 'question' is missing (the row has q)"),
    ({"q": 5}, {"prompt": "q"},
     "master.taskset.format.prompt: {file} row 2: column 'q' must be text, got int"),
    ({"q": "  "}, {"prompt": "q"}, "master.taskset.format.prompt: {file} row 2: column 'q' is "
                                   "empty"),
    ({"m": "hello"}, {"messages": "m"},
     "master.taskset.format.messages: {file} row 2: column 'm' must be a list of {role, "
     "content} messages, got str"),
    ({"m": [{"role": "user"}]}, {"messages": "m"},
     "master.taskset.format.messages: {file} row 2: column 'm' must be a list of {role, "
     "content} messages; message 1 has no content"),
    ({"m": [{"content": "hi"}]}, {"messages": "m"},
     "master.taskset.format.messages: {file} row 2: column 'm' must be a list of {role, "
     "content} messages; message 1 has no role"),
    ({"m": ["hi"]}, {"messages": "m"},
     "master.taskset.format.messages: {file} row 2: column 'm' must be a list of {role, "
     "content} messages; message 1 is str"),
    ({"m": [*CHAT, {"role": "assistant", "content": "4"}]}, {"messages": "m"},
     "master.taskset.format.messages: {file} row 2: column 'm' ends with an assistant message"),
    ({"q": "1", "a": None}, {"prompt": "q", "answer": "a"},
     "master.taskset.format.answer: {file} row 2: column 'a' is empty (null)"),
    ({"q": "1", "p": [1]}, {"prompt": "q", "args": "p"},
     "master.taskset.format.args: {file} row 2: column 'p' must be a mapping of reward "
     "argument to value (or JSON text of one), got list"),
    ({"q": "1", "i": 1.5}, {"prompt": "q", "id": "i"},
     "master.taskset.format.id: {file} row 2: column 'i' must be non-empty text or an integer, "
     "got 1.5"),
    ({"q": "1", "s": 3}, {"prompt": "q", "system_column": "s"},
     "master.taskset.format.system_column: {file} row 2: column 's' must be text, got int"),
    ({"q": "1"}, {"prompt": "q", "keep": ["level"]},
     "master.taskset.format.keep: {file} row 2: column 'level' is missing (the row has q)"),
])
def test_a_bad_row_is_one_line_naming_file_row_and_column(tmp_path, row, fmt, expected):
    good = {"q": "0", "question": "0", "m": CHAT, "a": "0", "p": {}, "i": 0, "s": "x",
            "level": "easy"}
    path = write_jsonl(tmp_path / "t.jsonl", [good, row])
    err = error_of(path, format=fmt)
    assert err.startswith(expected.replace("{file}", str(path))), err


def test_repeated_or_missing_ids_are_refused(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"k": "a", "q": "1"}, {"k": "a", "q": "2"}])
    assert error_of(path, format={"prompt": "q", "id": "k"}) == (
        f"master.taskset.format.id: {path} row 2: task id 'a' repeats {path} row 1; task ids "
        "must be unique")
    assert error_of(path, id_field="k") == (
        f"master.taskset.id_field: {path} row 2: task id 'a' repeats {path} row 1; task ids "
        "must be unique")
    write_jsonl(path, [{"k": "a"}, {"q": "2"}])
    assert error_of(path, id_field="k") == f"master.taskset.id_field: {path} row 2: no 'k' (has q)"


def test_bad_files_name_the_file_and_the_line(tmp_path):
    csv_path = tmp_path / "t.csv"
    csv_path.write_text("q,a\n1,2\n3\n")
    assert error_of(csv_path) == (f"master.taskset.path: {csv_path} row 2 (line 3): 1 cells, "
                                  "the header has 2")
    csv_path.write_text("q,q\n1,2\n")
    assert error_of(csv_path) == f"master.taskset.path: {csv_path}: the header repeats column 'q'"
    (tmp_path / "bad.jsonl").write_text('{"q": 1}\n{"q": \n')
    assert error_of(tmp_path / "bad.jsonl").startswith(
        f"master.taskset.path: {tmp_path / 'bad.jsonl'}:2: ")
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    assert error_of(tmp_path / "bad.parquet").startswith(
        f"master.taskset.path: {tmp_path / 'bad.parquet'}: the parquet reader failed: ")
    (tmp_path / "empty.csv").write_text("q,a\n")
    assert error_of(tmp_path / "empty.csv") == \
        f"master.taskset.path: {tmp_path / 'empty.csv'} holds no tasks"


def test_the_key_is_the_callers(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"q": 1}])
    assert error_of(path, key="eval.tasksets[0]", format={"prompt": "q"}).startswith(
        f"eval.tasksets[0].format.prompt: {path} row 1: column 'q' must be text")


# -- a plugin's reader and format -------------------------------------------------------------

PLUGIN = '''
from tandem.common.plugins import TASKSET_FORMATS, TASKSET_READERS
from tandem.common.tasks import BadRow


@TASKSET_READERS.register("kv", suffixes=(".kv",))
def read_kv(path, split, key):
    """One task per line: `name=value` pairs separated by `;`."""
    with open(path) as f:
        return [dict(pair.split("=", 1) for pair in line.strip().split(";"))
                for line in f if line.strip()]


@TASKSET_FORMATS.register("arith")
def arith(row, fmt, index):
    if "x" not in row or "y" not in row:
        raise BadRow("x" if "x" not in row else "y", "is missing", field="options")
    x, y = int(row["x"]), int(row["y"])
    return {"prompt": fmt.options["template"].format(x=x, y=y), "answer": str(x + y),
            "id": f"sum-{index}"}
'''


@pytest.fixture
def plugin(tmp_path):
    path = tmp_path / "my_tasks.py"
    path.write_text(textwrap.dedent(PLUGIN))
    load_plugins([str(path)])
    yield
    TASKSET_READERS.unregister("kv")
    TASKSET_FORMATS.unregister("arith")


def test_a_plugin_reader_and_format(tmp_path, plugin):
    data = tmp_path / "sums.kv"
    data.write_text("x=1;y=2\nx=3;y=4\n")
    fmt = {"name": "arith", "id": "x", "options": {"template": "{x} plus {y}?"}}
    expected = [{"prompt": "1 plus 2?", "answer": "3", "id": "sum-0"},
                {"prompt": "3 plus 4?", "answer": "7", "id": "sum-1"}]
    assert tasks(data, reader="kv", format=fmt) == expected
    assert tasks(data, format=fmt) == expected  # picked by the suffix it declares
    assert TASKSET_READERS.entry("kv").plugin == str(data.parent / "my_tasks.py")
    data.write_text("x=1;y=2\nx=3\n")
    assert error_of(data, format=fmt) == (
        f"master.taskset.format.options: {data} row 2: column 'y' is missing")
    data.write_text("x=1;y=two\n")
    assert error_of(data, format=fmt) == (
        f"master.taskset.format.name: the arith format failed on {data} row 1: ValueError: "
        "invalid literal for int() with base 10: 'two'")
