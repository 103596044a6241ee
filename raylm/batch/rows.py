"""The rows of a batch job: how input files become rows, what each row asks for, and how answers are written.

Every input row travels as two strings, its key and its JSON text (`KEY`, `LINE`), whatever its file's format:
request bodies differ from row to row (a prompt is a string here, a list of token ids there) and no columnar
schema holds them all. A row is one of two shapes, told apart by its fields:

- an OpenAI Batch request, `{"custom_id", "method": "POST", "url", "body"}`, answered as
  `{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}` with the body the server would
  answer; its key is its custom_id;
- a table row with `prompt` (text or token ids) or chat `messages`, and sampling settings (the job's defaults,
  then the row's own columns named like the OpenAI request fields, or a `sampling_params` object), written back
  as its own columns plus `generated_text`, `num_input_tokens`, `num_generated_tokens`, `finish_reason`,
  `logprobs` when asked, `error`, and `row_id` (its `id` column, else `FILE:INDEX`), its key.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Iterable, Iterator
from typing import Any

import pyarrow as pa
from ray.data.datasource import Datasink, FileBasedDatasource

KEY = "key"
LINE = "line"
BATCH_URLS = ("/v1/completions", "/v1/chat/completions")
INPUT_EXTENSIONS = ["jsonl", "json", "parquet"]
# Columns a table row's answer adds; a row's own columns of these names are replaced.
OUTPUT_COLUMNS = ("generated_text", "num_input_tokens", "num_generated_tokens", "finish_reason", "logprobs",
                  "error", "row_id")


class RowsDatasource(FileBasedDatasource):
    """JSONL (one object a line) and Parquet files as (key, JSON text) rows; a row's key is its custom_id, its
    `id`, or FILE:INDEX (the file's name and the row's index in it), so that a rerun finds the same keys."""

    _FILE_EXTENSIONS = INPUT_EXTENSIONS

    def __init__(self, paths: str | list[str], rows_per_block: int = 256, **file_args: Any):
        super().__init__(paths, file_extensions=INPUT_EXTENSIONS, **file_args)
        self.rows_per_block = rows_per_block

    def _read_stream(self, f: pa.NativeFile, path: str) -> Iterator[pa.Table]:
        name = path.rsplit("/", 1)[-1]
        if path.endswith(".parquet"):
            import pyarrow.parquet as pq

            table = pq.read_table(pa.BufferReader(f.read()))  # the stream is not seekable
            lines = (json.dumps(row, default=str) for row in table.to_pylist())
        else:
            lines = (line for line in f.read().decode("utf-8").splitlines() if line.strip())
        keys, texts = [], []
        for index, text in enumerate(lines):
            keys.append(row_key(text, f"{name}:{index}"))
            texts.append(text)
            if len(keys) == self.rows_per_block:
                yield pa.table({KEY: keys, LINE: texts})
                keys, texts = [], []
        if keys:
            yield pa.table({KEY: keys, LINE: texts})


def row_key(text: str, position: str) -> str:
    """An OpenAI request's custom_id, a table row's `id`, else its position; a line that is no JSON object keeps
    its position too (it is answered with an error)."""
    try:
        row = json.loads(text)
    except ValueError:
        return f"row:{position}"
    if isinstance(row, dict):
        if is_batch_request(row):
            return f"custom_id:{row['custom_id']}"
        if row.get("id") is not None:
            return f"row:{row['id']}"
    return f"row:{position}"


def is_batch_request(row: dict) -> bool:
    return "custom_id" in row and "body" in row


class AnswersDatasink(Datasink):
    """Writes each answer's JSON text as one line of a JSONL file per write task; returns what it wrote for the
    job's summary.

    Every answer is written exactly once, replicas dying or not: the writes are Ray Data tasks of their own, after
    the replicas' actor pool (Ray Data fuses no task after an actor pool), and a file is named by its write task's
    index, fixed when the task is submitted. A block whose replica died is answered again by Ray's retry of the
    replica's call, and its answers go to one write task like any block's; a write task whose worker or node died is
    run again by Ray with the same index, so it replaces the file it had begun (or finished) instead of adding one.
    On a cluster of several nodes the output must be storage every node writes to (a shared filesystem, s3://...).
    """

    def __init__(self, path: str):
        self.filesystem, self.path = filesystem_and_path(path)
        self.run_id = uuid.uuid4().hex[:8]

    def on_write_start(self, schema: Any = None) -> None:
        self.filesystem.create_dir(self.path, recursive=True)

    def write(self, blocks: Iterable[pa.Table], ctx: Any) -> dict[str, float]:
        counts = {"rows": 0, "errors": 0, "input_tokens": 0, "generated_tokens": 0, "peak_rows_in_flight": 0,
                  "answering_from": float("inf"), "answering_until": 0.0}
        name = f"{self.path}/answers-{self.run_id}-{ctx.task_idx:06d}.jsonl"
        with self.filesystem.open_output_stream(name) as out:
            for block in blocks:
                for text, failed, input_tokens, generated in zip(
                        block.column(LINE).to_pylist(), block.column("failed").to_pylist(),
                        block.column("input_tokens").to_pylist(), block.column("generated_tokens").to_pylist()):
                    out.write(text.encode("utf-8") + b"\n")
                    counts["rows"] += 1
                    counts["errors"] += int(failed)
                    counts["input_tokens"] += input_tokens
                    counts["generated_tokens"] += generated
                for key, most, column in (("peak_rows_in_flight", max, "rows_in_flight"),
                                          ("answering_from", min, "started"), ("answering_until", max, "finished")):
                    counts[key] = most(counts[key], most(block.column(column).to_pylist(), default=counts[key]))
        return counts

    def on_write_complete(self, write_result: Any) -> None:
        returns = write_result.write_returns
        self.totals = {key: sum(counts[key] for counts in returns)
                       for key in ("rows", "errors", "input_tokens", "generated_tokens")}
        self.totals["peak_rows_in_flight"] = max((counts["peak_rows_in_flight"] for counts in returns), default=0)
        begin = min((counts["answering_from"] for counts in returns), default=0.0)
        end = max((counts["answering_until"] for counts in returns), default=0.0)
        self.totals["answering_seconds"] = max(0.0, end - begin)


def filesystem_and_path(path: str) -> tuple[Any, str]:
    """The pyarrow filesystem of a local path or a URI, and the path within it (no trailing slash)."""
    import pyarrow.fs

    if "://" in path:
        filesystem, inner = pyarrow.fs.FileSystem.from_uri(path)
        return filesystem, inner.rstrip("/")
    return pyarrow.fs.LocalFileSystem(), path.rstrip("/")


def written_keys(path: str) -> set[str]:
    """The keys of the answers already under `path` (a job run again with resume skips their rows)."""
    import pyarrow.fs

    filesystem, root = filesystem_and_path(path)
    selector = pyarrow.fs.FileSelector(root, allow_not_found=True)
    keys = set()
    for info in filesystem.get_file_info(selector):
        if info.type != pyarrow.fs.FileType.File or not info.path.endswith(".jsonl"):
            continue
        with filesystem.open_input_stream(info.path) as handle:
            for line in handle.read().decode("utf-8").splitlines():
                key = answer_key(line)
                if key is not None:
                    keys.add(key)
    return keys


def answer_key(line: str) -> str | None:
    """The key of the row an answer line answers (None for a line cut short by a dying writer)."""
    try:
        answer = json.loads(line)
    except ValueError:
        return None
    if not isinstance(answer, dict):
        return None
    if "custom_id" in answer and "response" in answer:
        return f"custom_id:{answer['custom_id']}"
    if "row_id" in answer:
        return f"row:{answer['row_id']}"
    return None


def json_safe(value: Any) -> Any:
    """`value` with non-finite floats (a -inf logprob) as None, which JSON can hold."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, list):
        return [json_safe(item) for item in value]
    return value
