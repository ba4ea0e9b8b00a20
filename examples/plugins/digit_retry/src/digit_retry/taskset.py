"""The `digit_task` format: one row of this task's data (`uid`, `number`, `reversed`) made into
the task the workflow reads (`id`, `prompt`, `answer`).

    master:
      taskset:
        path: data/train.jsonl
        format: {name: digit_task, id: uid, answer: reversed, options: {number: number}}

The prompt is `options.prompt` (default `rev {number}=`, the form the quickstart's model was
warm-started on) filled with the number column. A row that cannot become a task raises
`BadRow` naming the column: tandem reports it as one line with the file and row.
"""

from __future__ import annotations

from typing import Any

from tandem.common.tasks import BadRow


def digit_task(row: dict[str, Any], fmt: Any, index: int) -> dict[str, Any]:
    """`fmt` is the `master.taskset.format` section; `index` the row's place in the taskset."""
    column = fmt.options.get("number", "number")
    number = row[column]  # a missing column: tandem names it and lists the row's columns
    if isinstance(number, bool) or not isinstance(number, int) or number < 0:
        raise BadRow(column, f"must be a whole number, got {number!r}")
    task = {"prompt": fmt.options.get("prompt", "rev {number}=").format(number=number),
            "answer": str(row[fmt.answer or "reversed"])}
    if fmt.id:
        task["id"] = str(row[fmt.id])
    return task
