"""Batch jobs (raylm/batch): rows and their keys, one replica's answers against the engine's own, and whole jobs
on a local Ray cluster (several replicas, JSONL and Parquet, bad rows, resume, the command line)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raylm.batch import BatchArgs, run_batch
from raylm.batch.job import replica_resources
from raylm.batch.replica import BatchReplica
from raylm.batch.rows import KEY, LINE, answer_key, row_key, written_keys

GREEDY = {"max_tokens": 6, "temperature": 0}


def _request(custom_id: str, url: str = "/v1/completions", **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def _write_jsonl(path: Path, rows: list) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))


def _answers(output: Path) -> list[dict]:
    return [json.loads(line) for file in sorted(output.glob("*.jsonl")) for line in file.read_text().splitlines()]


def test_row_keys_are_custom_ids_ids_or_positions_and_answers_give_them_back():
    request = json.dumps(_request("q-1", prompt="hi"))
    assert row_key(request, "f.jsonl:0") == "custom_id:q-1"
    assert row_key(json.dumps({"prompt": "hi", "id": 7}), "f.jsonl:3") == "row:7"
    assert row_key(json.dumps({"prompt": "hi"}), "f.jsonl:3") == "row:f.jsonl:3"
    assert row_key("not json", "f.jsonl:4") == "row:f.jsonl:4"
    assert answer_key(json.dumps({"custom_id": "q-1", "response": None, "error": None})) == "custom_id:q-1"
    assert answer_key(json.dumps({"row_id": "f.jsonl:3", "generated_text": "x"})) == "row:f.jsonl:3"
    assert answer_key('{"row_id": "cut sh') is None  # a line a dying writer left half written


def test_batch_args_are_checked_and_replicas_take_the_devices_their_engines_need():
    with pytest.raises(ValueError, match="num_replicas"):
        BatchArgs(input="in", output="out", num_replicas=0)
    with pytest.raises(ValueError, match="bogus"):
        BatchArgs(input="in", output="out", bogus=1)
    args = BatchArgs(input="in", output="out", max_seq_len=256)
    assert args.llm_options() == {"max_seq_len": 256}
    assert replica_resources(args, cluster_gpus=0) == ({"num_cpus": 1.0, "num_gpus": 0},
                                                       {"executor": "local", "device": "cpu"})
    assert replica_resources(args, cluster_gpus=8)[0]["num_gpus"] == 1
    with pytest.raises(ValueError, match="input '/nonexistent/rows.jsonl' does not exist"):
        run_batch(input="/nonexistent/rows.jsonl", output="out")  # before any cluster starts
    tp2 = BatchArgs(input="in", output="out", tensor_parallel_size=2)
    assert replica_resources(tp2, cluster_gpus=8) == ({"num_cpus": 1.0, "num_gpus": 0},
                                                      {"executor": "ray", "device": "cuda"})


@pytest.fixture(scope="module")
def replica(tiny_model_dirs):
    model = str(tiny_model_dirs["llama"])
    replica = BatchReplica({"model": model, "executor": "local", "device": "cpu", "max_seq_len": 256}, "tiny",
                           None, {"max_tokens": 4})
    yield replica
    replica.llm.shutdown()


def _call(replica: BatchReplica, rows: list) -> list[dict]:
    lines = [row if isinstance(row, str) else json.dumps(row) for row in rows]
    out = replica({KEY: [row_key(line, f"t.jsonl:{i}") for i, line in enumerate(lines)], LINE: lines})
    assert out[KEY] == [row_key(line, f"t.jsonl:{i}") for i, line in enumerate(lines)]
    return [json.loads(line) for line in out[LINE]]


def test_a_replica_answers_as_the_server_and_the_engine_do(replica):
    from raylm import SamplingParams

    prompt = "The capital of France is"
    greedy = replica.llm.generate([prompt], SamplingParams(max_tokens=6))[0].outputs[0].text
    completion, chat, table, default_table = _call(replica, [
        _request("c", prompt=prompt, **GREEDY),
        _request("m", url="/v1/chat/completions", messages=[{"role": "user", "content": "Hi"}], model="tiny",
                 **GREEDY),
        {"prompt": prompt, "topic": "geo", **GREEDY},
        {"prompt": prompt, "temperature": 0},
    ])
    assert completion["custom_id"] == "c" and completion["error"] is None
    assert completion["response"]["status_code"] == 200
    body = completion["response"]["body"]
    assert body["object"] == "text_completion" and body["model"] == "tiny" and body["choices"][0]["text"] == greedy
    assert chat["response"]["body"]["object"] == "chat.completion"
    assert table["generated_text"] == greedy and table["topic"] == "geo" and table["row_id"] == "t.jsonl:2"
    assert table["num_generated_tokens"] == 6 and table["finish_reason"] == "length" and table["error"] is None
    assert default_table["num_generated_tokens"] == 4  # the job's defaults, then the row's own fields
    assert default_table["generated_text"] == greedy[:len(default_table["generated_text"])]


def test_bad_rows_are_answered_with_errors_and_the_others_still_run(replica):
    answers = _call(replica, [
        _request("bad-field", prompt="x", max_tokens=-1),
        _request("wrong-model", prompt="x", model="other"),
        {"custom_id": "get", "method": "GET", "url": "/v1/models", "body": {}},
        {"prompt": ""},
        {"prompt": "x", "sampling_params": {"top_p": 7}},
        {"neither": 1},
        "not json",
        {"prompt": "fine", **GREEDY},
    ])
    bad_field, wrong_model, get, empty, bad_sampling, neither, not_json, fine = answers
    assert bad_field["response"]["status_code"] == 400
    assert bad_field["response"]["body"]["error"]["param"] == "max_tokens"
    assert wrong_model["response"]["status_code"] == 404
    assert get["response"] is None and "POST" in get["error"]["message"]
    assert "empty" in empty["error"]
    assert "top_p" in bad_sampling["error"]
    assert "prompt" in neither["error"] and "not JSON" in not_json["error"]
    assert fine["error"] is None and fine["num_generated_tokens"] == 6


@pytest.mark.usefixtures("ray_cluster")
class TestJobs:
    def test_two_replicas_answer_every_row_once_from_jsonl_and_parquet(self, tiny_model_dirs, tmp_path):
        import pyarrow as pa
        import pyarrow.parquet as pq

        inputs = tmp_path / "in"
        _write_jsonl(inputs / "requests.jsonl", [_request(f"r{i}", prompt=f"Row {i} says", **GREEDY)
                                                 for i in range(12)])
        inputs.mkdir(exist_ok=True)
        pq.write_table(pa.table({"prompt": [f"Table row {i}" for i in range(10)], "id": list(range(10))}),
                       inputs / "table.parquet")
        summary = run_batch(input=str(inputs), output=str(tmp_path / "out"), model=str(tiny_model_dirs["llama"]),
                            num_replicas=2, rows_per_block=3, sampling=GREEDY, max_seq_len=256)
        answers = _answers(tmp_path / "out")
        assert sorted(a["custom_id"] for a in answers if "custom_id" in a) == sorted(f"r{i}" for i in range(12))
        assert sorted(a["row_id"] for a in answers if "row_id" in a) == sorted(str(i) for i in range(10))
        assert summary.rows == 22 and summary.errors == 0 and summary.generated_tokens == 22 * 6

    def test_a_replica_answers_the_rows_of_several_blocks_at_once(self, tiny_model_dirs, tmp_path):
        """Blocks in flight run together in the one engine (not one block after another)."""
        _write_jsonl(tmp_path / "rows.jsonl", [{"prompt": f"Row {i} says"} for i in range(16)])
        summary = run_batch(input=str(tmp_path / "rows.jsonl"), output=str(tmp_path / "out"),
                            model=str(tiny_model_dirs["llama"]), rows_per_block=2, blocks_in_flight=4,
                            sampling={"max_tokens": 48, "temperature": 0, "ignore_eos": True}, max_seq_len=128)
        assert summary.rows == 16 and summary.errors == 0
        assert summary.peak_rows_in_flight > 2, summary
        assert 0 < summary.answering_seconds < summary.seconds

    def test_resume_skips_answered_rows_and_an_answered_output_is_not_overwritten(self, tiny_model_dirs,
                                                                                    tmp_path):
        inputs, output = tmp_path / "in" / "rows.jsonl", tmp_path / "out"
        options = dict(input=str(inputs), output=str(output), model=str(tiny_model_dirs["llama"]),
                       sampling=GREEDY, max_seq_len=256)
        _write_jsonl(inputs, [{"prompt": f"First {i}"} for i in range(4)])
        run_batch(**options)
        with pytest.raises(ValueError, match="already holds 4 answers"):
            run_batch(**options)
        _write_jsonl(inputs, [{"prompt": f"First {i}"} for i in range(4)] + [{"prompt": "Second"}])
        summary = run_batch(**options, resume=True)
        assert summary.rows == 1 and summary.skipped == 4
        assert sorted(a["row_id"] for a in _answers(output)) == [f"rows.jsonl:{i}" for i in range(5)]
        assert written_keys(str(output)) == {f"row:rows.jsonl:{i}" for i in range(5)}

    def test_the_command_line_runs_a_job(self, tiny_model_dirs, tmp_path, capsys):
        from raylm.cli import main

        _write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "Hello"}, _request("a", prompt="Hi")])
        code = main(["batch", "-i", str(tmp_path / "rows.jsonl"), "-o", str(tmp_path / "out"),
                     "--model", str(tiny_model_dirs["llama"]), "--max_tokens", "3", "--temperature", "0",
                     "--set", "max_seq_len=256"])
        assert code == 0
        assert "2 rows answered (0 with errors" in capsys.readouterr().out
        assert len(_answers(tmp_path / "out")) == 2
