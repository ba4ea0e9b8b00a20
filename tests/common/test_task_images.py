"""Images in tasks (docs/vision.md): read once when the taskset loads, from paths relative to
the taskset, Parquet/`datasets` image cells or OpenAI image content parts; normalised to one
PNG per picture; a bad image skips its task with one line naming the task and the column."""

from __future__ import annotations

import base64
import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from tandem.common.config.master import TasksetFormat
from tandem.common.errors import ConfigError
from tandem.common.images import BadImage, image_hash, normalise
from tandem.common.tasks import load_tasks


def png(color=(255, 0, 0), size=(8, 6), mode="RGB", fmt="PNG") -> bytes:
    out = io.BytesIO()
    Image.new(mode, size, color).save(out, format=fmt)
    return out.getvalue()


def write_jsonl(path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_paths_cells_and_content_parts_load_as_one_normalised_png(tmp_path):
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "red.png").write_bytes(png())
    (tmp_path / "red.bmp").write_bytes(png(fmt="BMP"))
    url = "data:image/png;base64," + base64.b64encode(png()).decode()
    write_jsonl(tmp_path / "tasks.jsonl", [
        {"q": "what colour?", "image": "img/red.png", "a": "red"},
        {"q": "what colour?", "image": ["red.bmp", "img/red.png"], "a": "red"},
    ])
    fmt = TasksetFormat(prompt="q", images="image", answer="a")
    tasks = load_tasks(str(tmp_path / "tasks.jsonl"), format=fmt)
    want = normalise(png())
    assert [len(t["images"]) for t in tasks] == [1, 2]
    assert all(i == want for t in tasks for i in t["images"])  # one picture, one byte string

    chats = tmp_path / "chats.jsonl"
    write_jsonl(chats, [{"conv": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "colour?"}]}]}])
    [chat] = load_tasks(str(chats), format=TasksetFormat(messages="conv"))
    assert chat["images"] == [want]
    assert chat["messages"][0]["content"][0] == {"type": "image"}

    table = pa.table({"q": ["colour?"], "picture": [{"bytes": png(), "path": None}]})
    pq.write_table(table, tmp_path / "cells.parquet")
    [cell] = load_tasks(str(tmp_path / "cells.parquet"),
                        format=TasksetFormat(prompt="q", images="picture"))
    assert image_hash(cell["images"][0]) == image_hash(want)


def test_a_bad_image_skips_its_task_with_one_line_naming_task_and_column(tmp_path):
    (tmp_path / "ok.png").write_bytes(png())
    (tmp_path / "cut.png").write_bytes(png(size=(64, 64), color=(1, 2, 3))[:60])
    (tmp_path / "text.png").write_bytes(b"not an image at all")
    bomb = io.BytesIO()
    Image.new("1", (5000, 5000)).save(bomb, format="PNG")  # 25 Mpixel canvas, a few KB
    (tmp_path / "bomb.png").write_bytes(bomb.getvalue())
    write_jsonl(tmp_path / "t.jsonl", [
        {"id": "good", "q": "?", "img": "ok.png"},
        {"id": "missing", "q": "?", "img": "nowhere.png"},
        {"id": "cut", "q": "?", "img": "cut.png"},
        {"id": "text", "q": "?", "img": "text.png"},
        {"id": "bomb", "q": "?", "img": "bomb.png"},
        {"id": "url", "q": "?", "img": "https://example.com/x.png"},
        {"id": "good2", "q": "?", "img": ["ok.png"]},
    ])
    skipped: list[str] = []
    tasks = load_tasks(str(tmp_path / "t.jsonl"), skipped=skipped,
                       format=TasksetFormat(prompt="q", images="img", id="id"))
    assert [t["id"] for t in tasks] == ["good", "good2"]  # the run goes on with the rest
    assert len(skipped) == 5
    for line, tid in zip(skipped, ["missing", "cut", "text", "bomb", "url"]):
        assert "\n" not in line
        assert f"(task {tid!r})" in line and "column 'img' image 1" in line, line
        assert line.endswith("task skipped")
    assert "cannot be read" in skipped[0]
    assert "cannot be decoded" in skipped[1]
    assert "not an image" in skipped[2]
    assert "5000x5000" in skipped[3] and "decompression-bomb" in skipped[3]
    assert "local files only" in skipped[4]


def test_a_bad_image_part_names_the_messages_column(tmp_path):
    write_jsonl(tmp_path / "c.jsonl", [{"conv": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,!!"}}]}]},
        {"conv": [{"role": "user", "content": "plain text"}]}])
    skipped: list[str] = []
    tasks = load_tasks(str(tmp_path / "c.jsonl"), skipped=skipped,
                       format=TasksetFormat(messages="conv"))
    assert len(tasks) == 1 and "images" not in tasks[0]
    assert "row 1" in skipped[0] and "column 'conv' image 1" in skipped[0]


def test_every_task_bad_is_a_config_error(tmp_path):
    write_jsonl(tmp_path / "t.jsonl", [{"q": "?", "img": "nowhere.png"}])
    with pytest.raises(ConfigError, match="holds no tasks"):
        load_tasks(str(tmp_path / "t.jsonl"), format=TasksetFormat(prompt="q", images="img"))


def test_normalise_depends_on_the_picture_not_the_encoding():
    assert normalise(png(fmt="BMP")) == normalise(png()) == normalise(png(mode="RGBA",
                                                                           color=(255, 0, 0, 255)))
    with pytest.raises(BadImage, match="not an image"):
        normalise(b"GIF89a-but-not-really")


def test_a_check_of_the_rows_alone_leaves_images_unread(tmp_path):
    """`tandem up` checks the rows before anything starts; the master reads the images."""
    write_jsonl(tmp_path / "t.jsonl", [{"q": "?", "img": "nowhere.png"}])
    skipped: list[str] = []
    [task] = load_tasks(str(tmp_path / "t.jsonl"), skipped=skipped, images=False,
                        format=TasksetFormat(prompt="q", images="img"))
    assert task["images"] == "nowhere.png" and skipped == []
