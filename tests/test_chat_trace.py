"""The chat reader (`requests.format: chat`) and its tokenizers: text conversations and logged
requests become token prompts whose sharing is exactly the text's."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import run_cli

from kvbench.errors import InputError, TraceWarning
from kvbench.oracle import reference_hit_rates
from kvbench.traffic import TraceOptions, open_trace, sniff
from kvbench.traffic.sessions import SessionStart
from kvbench.traffic.tokenize import APPROX_LETTERS, ApproxTokenizer, open_tokenizer

ROOT = Path(__file__).resolve().parents[1]
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
SHAREGPT = [
    {"id": "a", "conversations": [
        {"from": "human", "value": "Hello there, how are you?"},
        {"from": "gpt", "value": "I am fine, thanks. How can I help?"},
        {"from": "human", "value": "Tell me a joke about caches."},
        {"from": "gpt", "value": "Why did the block leave? It was evicted!"}]},
    {"id": "b", "conversations": [
        {"from": "system", "value": "You are terse."},
        {"from": "human", "value": "2+2?"},
        {"from": "gpt", "value": "4"}]},
]


def lines(path: Path, *records) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n"
                            for r in records))
    return path


def read(path, **kw):
    return list(open_trace(path, "auto", TraceOptions(**kw)))


def template(messages, roles=("role", "content")) -> list[str]:
    """The independent reading of the prompt template: header and content per message."""
    names = {"human": "user", "gpt": "assistant"}
    out = []
    for m in messages:
        out += [f"<|{names.get(m[roles[0]], m[roles[0]])}|>\n", m[roles[1]]]
    return out


def tokens_of(pieces: list[str]) -> np.ndarray:
    return np.concatenate(ApproxTokenizer().encode(pieces))


# --- conversations and requests ------------------------------------------------------------------


def test_sharegpt_array_is_a_session_per_conversation(tmp_path):
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(SHAREGPT, indent=1))
    assert sniff(path) == ("chat", "a chat trace (`conversations`)")
    reqs = read(path, sessions=SessionStart("stagger", interval_s=5.0, turn_interval_s=2.0))
    assert [r.arrival_s for r in reqs] == [0.0, 2.0, 5.0]
    first, second, other = reqs
    msgs = SHAREGPT[0]["conversations"]
    # One tokenizer for the whole trace: equal pieces, equal ids; compare as text pieces.
    tok = ApproxTokenizer()
    want = np.concatenate(tok.encode(template(msgs[:1], ("from", "value"))
                                     + ["<|assistant|>\n"]))
    assert first.input_length == len(want)
    assert second.tokens[:first.input_length].tolist() == first.tokens.tolist()
    # The answer is decoded after the prompt and read again by the next turn.
    stream = np.concatenate([first.tokens, first.output_tokens])
    assert second.tokens[:len(stream)].tolist() == stream.tolist()
    assert first.output_length == len(tok.encode([msgs[1]["value"]])[0])
    assert other.input_length < first.input_length + 10 and other.output_length == 1


def test_openai_requests_batch_lines_and_prompts(tmp_path):
    image = {"type": "image_url", "image_url": {"url": "data:"}}
    path = lines(
        tmp_path / "o.jsonl",
        {"messages": [SYSTEM, {"role": "user", "content": "What is a KV cache?"}],
         "max_tokens": 100},
        {"messages": [SYSTEM, {"role": "user", "content": "What is a KV cache?"},
                      {"role": "assistant", "content": None,
                       "tool_calls": [{"id": "c", "function": {"name": "f"}}]},
                      {"role": "user", "content": [{"type": "text", "text": "And pages?"}, image]}],
         "max_completion_tokens": 50, "max_tokens": 9},
        {"custom_id": "r3", "method": "POST", "body": {"messages": [
            {"role": "user", "content": "hi"}]}},
        {"prompt": "Once upon a time"},
        {"model": "m", "instructions": "You are a helpful assistant.", "max_output_tokens": 3,
         "input": [{"role": "user", "content": [{"type": "input_text",
                                                 "text": "What is a KV cache?"}]}]},
        {"input": "Once upon a time"})
    assert sniff(path)[0] == "chat"
    with pytest.warns(TraceWarning, match="1 message parts that are not text"):
        reqs = read(path, output_length=7)
    assert [r.output_length for r in reqs] == [100, 50, 7, 7, 3, 7]
    # Responses API: `instructions` is the system message, `input` the messages or a prompt.
    assert reqs[4].tokens.tolist() == reqs[0].tokens.tolist()
    hello = template([{"role": "user", "content": "Once upon a time"}]) + ["<|assistant|>\n"]
    assert reqs[5].input_length == len(tokens_of(hello))
    assert all(r.output_tokens is None for r in reqs)  # the answer is not in the log
    # A logged call with its history shares the earlier call's prompt, bar its last header.
    a, b = reqs[0].tokens, reqs[1].tokens
    shared = len(tokens_of(template([SYSTEM, {"role": "user", "content": "What is a KV cache?"}])))
    assert b[:shared].tolist() == a[:shared].tolist()
    assert len(a) == shared + len(tokens_of(["<|assistant|>\n"]))
    assert reqs[3].input_length == len(tokens_of(["Once upon a time"]))


def test_conversation_hit_rates_equal_token_replay(tmp_path):
    """Reuse of a chat trace is what the same token prompts get: the reader adds nothing."""
    path = lines(tmp_path / "c.jsonl", *SHAREGPT, *SHAREGPT)
    reqs = read(path)
    again = [type(r)(id=r.id, arrival_s=r.arrival_s, input_length=r.input_length,
                     output_length=r.output_length, tokens=r.tokens.copy()) for r in reqs]
    for tpb in (1, 4, 16):
        assert reference_hit_rates(reqs, tpb, 64, partial_reuse=True) == \
            reference_hit_rates(again, tpb, 64, partial_reuse=True)
    # The second copy of each conversation reuses all of its prompt but the last token.
    n = len(reqs) // 2
    assert [r.tokens.tolist() for r in reqs[:n]] == [r.tokens.tolist() for r in reqs[n:]]


def test_timestamps_start_records_and_turns_follow(tmp_path):
    path = lines(tmp_path / "t.jsonl", dict(SHAREGPT[1], timestamp=4000),
                 dict(SHAREGPT[0], timestamp=1000))
    reqs = read(path, sessions=SessionStart(turn_interval_s=1.5))
    assert [r.arrival_s for r in reqs] == [1.0, 2.5, 4.0]
    path = lines(tmp_path / "m.jsonl", dict(SHAREGPT[1], timestamp=0), SHAREGPT[0])
    with pytest.raises(InputError, match=r"m.jsonl:2: 'timestamp' on a record|m.jsonl:2: .*"
                       "'timestamp'"):
        read(path)


def test_a_record_without_requests_is_skipped(tmp_path):
    """A lone assistant message has no prompt: its record is skipped, not a session of -1
    turns that would start the next one a turn interval early (a negative arrival)."""
    answer = {"messages": [{"role": "assistant", "content": "hi"}]}
    path = lines(tmp_path / "a.jsonl", answer, SHAREGPT[1], SHAREGPT[1])
    reader = open_trace(path, "chat", TraceOptions())
    assert [r.arrival_s for r in reader] == [0.0, 0.0]
    assert reader.without_prompt == 1


def test_an_empty_prompt_is_skipped(tmp_path, capsys):
    """A prompt of no tokens has nothing to prefill, nor has a conversation of no messages
    (ShareGPT's releases hold some): skipped and counted; a run of one would fail, not
    measure."""
    path = lines(tmp_path / "e.jsonl", {"prompt": ""}, {"prompt": "", "max_tokens": 3},
                 {"conversations": []}, {"prompt": "hi"})
    reader = open_trace(path, "chat", TraceOptions())
    assert [r.input_length for r in reader] == [1]
    assert reader.without_prompt == 3
    workload = tmp_path / "w.yaml"
    workload.write_text((ROOT / "workloads" / "formats" / "chat.yaml").read_text()
                        .replace("samples/chat.jsonl", str(path)))
    for mode in ("cache", "serve"):
        code, _, err = run_cli(["run", workload, "-q", "--set", f"run.mode={mode}"], capsys)
        assert code == 0, err


def test_convert_to_mooncake_names_the_option_it_needs(tmp_path, capsys):
    path = lines(tmp_path / "c.jsonl", *SHAREGPT)
    out = tmp_path / "m.jsonl"
    code, _, err = run_cli(["trace", "convert", path, out], capsys)
    assert code == 2 and "--out-block-tokens: required to convert a chat trace" in err, err
    code, _, err = run_cli(["trace", "convert", path, out, "--out-block-tokens", "16"], capsys)
    assert code == 0 and len(out.read_text().splitlines()) == 3, err


def test_approx_tokenizer_pieces():
    tok = ApproxTokenizer()
    (a, b) = tok.encode(["Hello, world! 12345", "Hello"])
    # Hello / , / " world" / ! / " " / 123 / 45: as cl100k, digits in threes without a space
    assert len(a) == 7
    assert b.tolist() == a[:1].tolist()
    long = "x" * (3 * APPROX_LETTERS + 1)
    assert len(tok.encode([long])[0]) == 4


# --- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("record", "message"), [
    ({"messages": ["hi"]}, "'messages' must hold message objects, got \"hi\""),
    ({"messages": [{"content": "x"}]}, "a message of 'messages' needs a 'role' string, got null"),
    ({"conversations": [{"from": "human", "value": 3}]},
     "'value' must be a string, null or a list of parts, got 3"),
    ({"messages": [{"role": "user", "content": [3]}]},
     "'content' parts must be objects or strings, got 3"),
    ({"prompt": ["a", "b"]}, "'prompt' must be a string, got [\"a\", \"b\"]"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": -1},
     "'max_tokens' must be in [0, 16777215], got -1"),
    ({"text": "x"}, "expected 'messages', 'conversations', 'conversation', 'input' or "
                    "'prompt'"),
    ({"input": 3}, "'input' must be a list of messages, got 3"),
    ({"input": "x", "instructions": ["y"]}, "'instructions' must be a string, got [\"y\"]"),
    ({"messages": "hi"}, "'messages' must be a list of messages, got \"hi\""),
])
def test_bad_records_name_their_line(tmp_path, capsys, record, message):
    path = lines(tmp_path / "b.jsonl", SHAREGPT[0], record)
    code, _, err = run_cli(["trace", "stats", path, "--format", "chat"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert err.strip().startswith(f"kvbench: error: {path}:2: {message}"), err


@pytest.mark.parametrize(("text", "line", "message"), [
    ('[\n{"prompt": "a"},\n{"prompt": 1}\n]', 3, "'prompt' must be a string"),
    ('[\n{"prompt": "a"}\n{"prompt": "b"}]', 3, "expected ',' or ']' after an array element"),
    ('[\n{"prompt": "a"},\n\n{"prompt": "b"\n]', 5, "invalid JSON at column 1"),
    ('[{"prompt": "a"}]\n{"prompt": "b"}', 2, "extra data after the JSON array"),
    ('[{"prompt": "a"},\n 7]', 2, "expected a JSON object, got a number"),
])
def test_bad_arrays_name_their_line(tmp_path, capsys, text, line, message):
    path = tmp_path / "a.json"
    path.write_text(text)
    code, _, err = run_cli(["trace", "stats", path], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert err.strip().startswith(f"kvbench: error: {path}:{line}: {message}"), err


def test_an_array_after_many_blank_lines(tmp_path):
    path = tmp_path / "a.json"
    path.write_text("\n" * 5000 + json.dumps(SHAREGPT, indent=1))
    assert len(read(path)) == 3


def test_an_array_of_other_records_is_refused(tmp_path, capsys):
    path = tmp_path / "m.json"
    path.write_text(json.dumps([{"timestamp": 0, "input_length": 3, "output_length": 1,
                                 "hash_ids": [1]}]))
    code, _, err = run_cli(["trace", "stats", path], capsys)
    assert code == 2 and "a JSON array whose first element is not a chat record" in err


def test_tokenizer_only_for_chat_and_bad_files(tmp_path, capsys):
    chat = lines(tmp_path / "c.jsonl", *SHAREGPT)
    moon = lines(tmp_path / "m.jsonl", {"timestamp": 0, "input_length": 3, "output_length": 1,
                                        "hash_ids": [1]})
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{}")
    code, _, err = run_cli(["run", ROOT / "workloads" / "quickstart.yaml", "--set",
                            f"requests.tokenizer={bad}"], capsys)
    assert code == 2 and err.strip() == ("kvbench: error: --set requests.tokenizer: only used by "
                                         "chat traces (requests.source: trace), not by the "
                                         "synthetic generator")
    for args, message in [
        ([moon, "--tokenizer", bad], "requests.tokenizer: only chat traces are tokenized "
                                     "(this trace is mooncake)"),
        ([chat, "--tokenizer", tmp_path / "none.json"], "requests.tokenizer: no tokenizer file"),
        ([chat, "--tokenizer", tmp_path], f"{bad}: not a Hugging Face tokenizer.json"),
    ]:
        code, _, err = run_cli(["trace", "stats", *args], capsys)
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert message in err, err


# --- a model's tokenizer -------------------------------------------------------------------------


def word_tokenizer(folder: Path):
    """A small word-level tokenizer.json for the SHAREGPT texts, saved in `folder`."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    corpus = [m["value"] for c in SHAREGPT for m in c["conversations"]]
    tok.train_from_iterator(corpus + ["<|user|> <|assistant|> <|system|>"],
                            trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    folder.mkdir(parents=True)
    tok.save(str(folder / "tokenizer.json"))
    return tok


def test_a_tokenizer_file_gives_the_models_ids(tmp_path, capsys):
    folder = tmp_path / "model"
    tok = word_tokenizer(folder)
    path = lines(tmp_path / "c.jsonl", *SHAREGPT)
    reqs = read(path, tokenizer=str(folder))
    msgs = SHAREGPT[0]["conversations"]
    pieces = template(msgs[:3], ("from", "value")) + ["<|assistant|>\n"]
    want = np.concatenate([tok.encode(p, add_special_tokens=False).ids for p in pieces])
    assert reqs[1].tokens.tolist() == want.tolist()
    assert open_tokenizer(str(folder)).name == str(folder / "tokenizer.json")
    code, out, err = run_cli(["trace", "stats", path, "--tokenizer", folder / "tokenizer.json",
                              "--json", "-"], capsys)
    assert code == 0, err
    assert json.loads(out)["tokenizer"] == str(folder / "tokenizer.json")


def test_a_lone_surrogate_reaches_a_tokenizer_file_as_a_replacement_character(tmp_path):
    """JSON may escape half a surrogate pair (an emoji cut in two); Rust text cannot hold one."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    tok = tokenizers.Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    path = tmp_path / "s.jsonl"
    path.write_text('{"prompt": "a \\ud83d a"}\n{"prompt": "a \\ufffd a"}\n')
    cut, replaced = read(path, tokenizer=str(tmp_path))
    assert cut.tokens.tolist() == replaced.tokens.tolist() == [1, 0, 1]


def test_a_tokenizer_that_cannot_encode_names_the_record(tmp_path, capsys):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    tok = tokenizers.Tokenizer(models.WordLevel({"a": 0}))  # no unk token: "b" cannot encode
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    path = lines(tmp_path / "c.jsonl", {"prompt": "a"}, {"prompt": "b"})
    code, _, err = run_cli(["trace", "stats", path, "--tokenizer", tmp_path], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"kvbench: error: {path}:2: {tmp_path / 'tokenizer.json'} cannot "
                          "encode this record (WordLevel error: Missing [UNK] token"), err


def test_exported_best_reads_the_same_tokenizer_and_profile(tmp_path, capsys):
    """A workload's tokenizer and hardware profile are relative to its own folder: the best
    trial exported elsewhere must still find them (and the trace)."""
    word_tokenizer(tmp_path / "w" / "model")
    lines(tmp_path / "w" / "c.jsonl", *SHAREGPT, *SHAREGPT)
    (tmp_path / "w" / "h200.yaml").write_text(
        (ROOT / "profiles" / "nvidia-h200-mooncake-conversation-serve.yaml").read_text())
    workload = tmp_path / "w" / "t.yaml"
    workload.write_text(
        (ROOT / "workloads" / "formats" / "chat.yaml").read_text()
        .replace("samples/chat.jsonl", "c.jsonl").replace("tokenizer: approx",
                                                          "tokenizer: model")
        + "hardware: {profile: h200.yaml}\n"
        + "tune: {space: {cache.tokens_per_block: {choices: [4, 8]}}, n_trials: 2, seed: 1,"
          " objectives: [{metric: hit_rate, direction: maximize}]}\n")
    best = tmp_path / "elsewhere" / "best.yaml"
    best.parent.mkdir()
    code, _, err = run_cli(["tune", workload, "--quiet", "--storage",
                            f"sqlite:///{tmp_path}/s.db", "--export-best", best], capsys)
    assert code == 0, err
    text = best.read_text()
    assert "tokenizer: ../w/model" in text and "profile: ../w/h200.yaml" in text, text
    code, _, err = run_cli(["run", best, "--quiet"], capsys)
    assert code == 0, err
