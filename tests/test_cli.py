"""`raylm generate`: prompts from arguments, a file and stdin; streaming; chat; errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from raylm.cli import main

SMALL = ["--kv_cache_max_tokens", "2048", "--max_seq_len", "512"]


def test_generate_streams_the_continuation_of_an_argument_prompt(capsys):
    assert main(["generate", "The capital of France is", "--max_tokens", "3", *SMALL]) == 0
    assert capsys.readouterr().out.startswith("The capital of France is Paris.")


def test_generate_reads_a_prompts_file_and_prints_json_lines(tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The capital of France is\n\nHello, my name is\n")
    assert main(["generate", "--prompts_file", str(prompts), "--json", "--max_tokens", "4", *SMALL]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["prompt"] for r in records] == ["The capital of France is", "Hello, my name is"]
    assert records[0]["outputs"][0]["text"].startswith(" Paris")
    assert all(len(r["outputs"][0]["token_ids"]) == 4 for r in records)


def test_generate_chat_from_stdin_applies_the_chat_template():
    result = subprocess.run(
        [sys.executable, "-m", "raylm.cli", "generate", "--chat", "--json", "--max_tokens", "16", *SMALL],
        input="What is the capital of France?\n", capture_output=True, text=True, timeout=300, check=True,
    )
    record = json.loads(result.stdout.strip().splitlines()[-1])
    assert "Paris" in record["outputs"][0]["text"]


def test_generate_sampling_flags_and_n_print_every_completion(capsys):
    args = ["generate", "Once upon a time", "--n", "2", "--temperature", "0.9", "--top_p", "0.9", "--seed", "1",
            "--max_tokens", "5", *SMALL]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "[0]" in out and "[1]" in out


@pytest.mark.parametrize(("flag", "value", "message"), [("--temperature", "-1", "temperature"),
                                                        ("--top_p", "1.5", "top_p")])
def test_generate_bad_sampling_flag_exits_2_naming_the_field(flag, value, message, capsys):
    assert main(["generate", "hi", flag, value, *SMALL]) == 2
    assert message in capsys.readouterr().err


def test_generate_unknown_model_exits_2(capsys):
    assert main(["generate", "hi", "--model", "/no/such/model/dir"]) == 2
    assert "not an existing directory" in capsys.readouterr().err


def test_generate_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--help"])
    assert exit_info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "most tokens to generate (default: 128)" in out and "(default: 256)" in out
    assert "greedy, unless top_k / top_p / min_p is set (default: None)" in out


def test_generate_with_a_missing_prompts_file_is_a_one_line_error(tmp_path):
    missing = tmp_path / "missing.txt"
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--prompts_file", str(missing)])
    message = f"raylm generate: error: cannot read --prompts_file {missing}: No such file or directory"
    assert exit_info.value.code == message


def test_an_unknown_generate_flag_shows_the_generate_usage(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "hi", "--bogus"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith("usage: raylm generate")
    assert "raylm generate: error: unrecognized arguments: --bogus" in error
