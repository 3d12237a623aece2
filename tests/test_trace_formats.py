"""Trace formats: every reader against a brute-force reference at the trace's own granularity,
strict one-line errors, ceil/floor detection, id remapping, weka sub-agents, sniffing, unit
warnings, stats, convert, and one workload per format on samples the tests write."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import run_cli
from hypothesis import given, settings
from hypothesis import strategies as st
from test_oracle import brute_ideal, brute_optimal, replay
from trace_samples import write_samples

from kvbench.errors import InputError
from kvbench.oracle import reference_hit_rates
from kvbench.traffic import TraceOptions, TraceWarning, open_trace, sniff, trace_stats
from kvbench.traffic.request import Request
from kvbench.traffic.sessions import SessionStart
from kvbench.traffic.tracefile import MAX_INT_DIGITS

ROOT = Path(__file__).resolve().parents[1]
B = 4  # hash block size of the small brute-force traces


def write(path: Path, *objs) -> Path:
    path.write_text("".join((o if isinstance(o, str) else json.dumps(o)) + "\n" for o in objs))
    return path


def expand(prompts, block=B) -> list[Request]:
    """The independent reading of a hash-id trace: explicit tokens, block j of a prompt made of
    tokens of the raw prefix (root, ids[0..j]) - equal prefixes give equal tokens, nothing else
    does - and a tail without an id (floor) made of tokens of its own. `prompts`: (root, raw ids,
    input length) in arrival order."""
    table: dict = {}
    out = []
    for i, (root, ids, length) in enumerate(prompts):
        toks = []
        for j in range(-(-length // block)):
            key = (root, tuple(ids[:j + 1])) if j < len(ids) else ("tail", i)
            base = table.setdefault(key, len(table)) * block
            toks.extend(range(base, base + block))
        out.append(Request(i, 0.0, length, 1, tokens=np.array(toks[:length], dtype=np.int64)))
    return out


def assert_matches_brute_force(reqs, reference, capacity=6):
    """Hit, ideal and optimal of the reader's requests equal those of the brute-force token
    reading, at the native block size and around it."""
    assert [r.input_length for r in reqs] == [r.input_length for r in reference]
    for tpb in (B, 2 * B, B // 2, 3):
        cap = max(capacity, max(-(-r.input_length // tpb) for r in reqs))
        refs = reference_hit_rates(reqs, tpb, cap, partial_reuse=False)
        assert refs.ideal_reused_tokens == brute_ideal(reference, tpb, False), tpb
        assert replay(reqs, tpb, cap, False) == replay(reference, tpb, cap, False), tpb
        if tpb >= B:  # exhaustive search: keep it small
            assert refs.optimal_reused_tokens == brute_optimal(reference, tpb, cap), tpb
        partial = reference_hit_rates(reqs, tpb, cap, partial_reuse=True)
        assert partial.ideal_reused_tokens == brute_ideal(reference, tpb, True), tpb
        for r in reqs:
            r.drop_keys()


def read(path, fmt, **kw):
    return list(open_trace(path, fmt, TraceOptions(**kw)))


# --- each format against brute force -------------------------------------------------------------


def test_mooncake_native_block_size(tmp_path):
    lines = [(0, 10, ["a", "b", "c"]), (5, 12, ["a", "b", "d"]), (7, 6, ["a", "b"]),
             (9, 14, [2**64, "b2", "x", "y"]), (9, 9, ["a", "b", "c"])]
    path = write(tmp_path / "m.jsonl", *({"timestamp": t, "input_length": n, "output_length": 1,
                                          "hash_ids": ids} for t, n, ids in lines))
    reqs = read(path, "mooncake", block_tokens=B)
    assert [r.arrival_s for r in reqs] == [0, 0.005, 0.007, 0.009, 0.009]
    assert_matches_brute_force(reqs, expand([(None, ids, n) for _, n, ids in lines]))


def test_mooncake_floor_and_auto_detection(tmp_path):
    lines = [(10, ["a", "b"]), (13, ["a", "b", "c"]), (8, ["a", "b"])]
    path = write(tmp_path / "m.jsonl", *({"timestamp": 0, "input_length": n, "output_length": 1,
                                          "hash_ids": ids} for n, ids in lines))
    reqs = read(path, "mooncake", block_tokens=B, hash_ids_cover="floor")
    assert_matches_brute_force(reqs, expand([(None, ids, n) for n, ids in lines]))
    reader = open_trace(path, "mooncake", TraceOptions(block_tokens=B, hash_ids_cover="auto"))
    assert len(list(reader)) == 3 and reader.convention() == "floor"
    with pytest.raises(InputError, match=r"m.jsonl:1: 'hash_ids' has 2 ids, but input_length 10 "
                       r"needs 3 \(blocks of 4 tokens\); it fits requests.hash_ids_cover: floor$"):
        read(path, "mooncake", block_tokens=B)


def test_auto_cover_rejects_a_mix(tmp_path):
    path = write(tmp_path / "m.jsonl",
                 {"timestamp": 0, "input_length": 8, "output_length": 1, "hash_ids": [1, 2]},
                 {"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1, 2, 3]},
                 {"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1, 2]})
    with pytest.raises(InputError, match=r"m.jsonl:3: .* this line counts floor but line 2 "
                       "counted ceil: a trace must use one convention$"):
        read(path, "mooncake", block_tokens=B, hash_ids_cover="auto")
    reader = open_trace(path, "mooncake", TraceOptions(block_tokens=B, hash_ids_cover="auto",
                                                       limit=1))
    list(reader)
    assert reader.convention() == "ceil or floor (every input_length a multiple of 4)"


def test_aiperf_sessions_delays_and_missing_ids(tmp_path):
    path = write(tmp_path / "a.jsonl",
                 {"session_id": "s1", "input_length": 8, "output_length": 1, "hash_ids": [1, 2]},
                 {"session_id": "s2", "input_length": 6, "output_length": 1},
                 {"session_id": "s1", "delay": 2000, "input_length": 12, "output_length": 1,
                  "hash_ids": [1, 2, 3]},
                 {"session_id": "s2", "delay": 500, "input_length": 9, "output_length": 1})
    reqs = read(path, "mooncake", block_tokens=B,
                sessions=SessionStart("stagger", interval_s=1.0))
    assert [(r.arrival_s, r.input_length) for r in reqs] == [(0, 8), (1, 6), (1.5, 9), (2, 12)]
    # Prompts without ids share nothing, not even with each other.
    reference = expand([(None, [1, 2], 8), (None, ["u1"], 6), (None, ["u2"], 9),
                        (None, [1, 2, 3], 12)])
    assert_matches_brute_force(reqs, reference)


def test_bailian(tmp_path):
    rows = [(0.5, 10, [7, 8, 9]), (1.0, 12, [7, 8, 5]), (1.0, 16, [7, 8, 9, 4])]
    path = write(tmp_path / "b.jsonl", *(
        {"chat_id": i, "parent_chat_id": -1 if i == 0 else 0, "timestamp": t, "input_length": n,
         "output_length": 3, "type": "text", "turn": 1 + (i > 0), "hash_ids": ids}
        for i, (t, n, ids) in enumerate(rows)))
    reqs = read(path, "bailian", block_tokens=B)
    assert [r.arrival_s for r in reqs] == [0.5, 1.0, 1.0]
    assert_matches_brute_force(reqs, expand([(None, ids, n) for _, n, ids in rows]))


def test_servegen_equal_ids_share_whatever_the_images(tmp_path):
    # The release's own example (data/offline/README.md): two captioning requests with
    # different images share their first 23 blocks, "a common 368-token prefix whose KV cache
    # can be reused".
    rows = [(10, [1, 2, 3], [5]), (10, [1, 2, 3], [6]), (10, [1, 2, 3], []),
            (12, [1, 2, 4], [5]), (9, [1, 2, 3], [])]
    path = write(tmp_path / "s.jsonl", *(
        {"request_id": f"r{i}", "type": "mm", "input_length": n, "hash_ids": ids, "img_ids": im}
        for i, (n, ids, im) in enumerate(rows)))
    reqs = read(path, "servegen", block_tokens=B, output_length=9,
                sessions=SessionStart("poisson", rate=2.0), seed=3)
    assert all(r.output_length == 9 for r in reqs)
    arrivals = [r.arrival_s for r in reqs]
    assert arrivals[0] == 0 and arrivals == sorted(arrivals) and arrivals[-1] > 0
    assert_matches_brute_force(reqs, expand([(None, ids, n) for n, ids, _ in rows]))
    assert reference_hit_rates(reqs[:2], B, None, partial_reuse=False).ideal_reused_tokens == 8


def test_servegen_stat_traces(tmp_path, capsys):
    # data/offline/trace_d.jsonl: lengths and durations, no hash_ids; sniffed as ServeGen.
    path = write(tmp_path / "trace_d.jsonl",
                 {"request_id": 0, "type": "text", "input_length": 61, "output_length": 2370,
                  "duration": 14000},
                 {"request_id": 1, "type": "text", "input_length": 54, "output_length": 2031,
                  "duration": 11630})
    assert sniff(path)[0] == "servegen"
    reader = open_trace(path, "auto", TraceOptions(output_length=7))
    reqs = list(reader)
    assert [(r.arrival_s, r.input_length, r.output_length) for r in reqs] == [
        (0, 61, 2370), (0, 54, 2031)]
    assert reader.without_ids == 2
    # No record has ids: no length convention to report (it said "every input_length a
    # multiple of 16" of lengths 61 and 54).
    assert reader.convention() == "none (no record has hash_ids)"
    assert_matches_brute_force(reqs, expand([(None, ["a"], 61), (None, ["b"], 54)], block=16))
    write(path, {"request_id": 0, "type": "text", "input_length": 61, "output_length": -1})
    code, _, err = run_cli(["trace", "stats", path], capsys)
    assert code == 2 and err.strip().endswith(
        "trace_d.jsonl:1: 'output_length' must be in [0, 16777215], got -1")


def weka_doc(scope="local", requests=None, block=B):
    return {"id": "c", "models": ["big", "small"], "block_size": block, "hash_id_scope": scope,
            "tool_tokens": 0, "system_tokens": 4, "requests": requests}


def test_weka_subagents_scopes_and_times(tmp_path):
    folder = tmp_path / "w"
    folder.mkdir()
    a = [{"t": 0, "type": "n", "model": "big", "in": 9, "out": 2, "hash_ids": [1, 2]},
         {"t": 4, "type": "subagent", "requests": [
             {"t": 0.5, "type": "s", "model": "small", "in": 8, "out": 1, "hash_ids": [1, 2]},
             {"t": 2, "type": "subagent", "requests": [
                 {"t": 1, "type": "n", "model": "small", "in": 13, "out": 1,
                  "hash_ids": [1, 2, 3]}]}]},
         {"t": 10, "type": "n", "model": "big", "in": 14, "out": 2, "hash_ids": [1, 2, 9]}]
    b = [{"t": 0, "type": "n", "model": "big", "in": 12, "out": 2, "hash_ids": [1, 2, 9]},
         {"t": 3, "type": "n", "model": "big", "in": 9, "out": 2, "hash_ids": [1, 2]}]
    (folder / "a.json").write_text(json.dumps(weka_doc("local", a), indent=1))
    (folder / "b.json").write_text(json.dumps(weka_doc("local", b), indent=1))
    reader = open_trace(folder, "weka", TraceOptions(
        sessions=SessionStart("stagger", interval_s=2.0)))
    reqs = list(reader)
    # a: 0, 4.5 (sub-agent), 7 (nested sub-agent: 4 + 2 + 1), 10; b starts at 2: 2, 5.
    assert [(r.arrival_s, r.input_length) for r in reqs] == [
        (0, 9), (2, 12), (4.5, 8), (5, 9), (7, 13), (10, 14)]
    assert reader.subagents == 2 and reader.convention() == "floor" and reader.block_tokens == B
    # Local scope: ids are per file; models never share.
    reference = expand([(("a", "big"), [1, 2], 9), (("b", "big"), [1, 2, 9], 12),
                        (("a", "small"), [1, 2], 8), (("b", "big"), [1, 2], 9),
                        (("a", "small"), [1, 2, 3], 13), (("a", "big"), [1, 2, 9], 14)])
    assert_matches_brute_force(reqs, reference)
    # Global scope: the two files share.
    (folder / "a.json").write_text(json.dumps(weka_doc("global", a)))
    (folder / "b.json").write_text(json.dumps(weka_doc("global", b)))
    reqs = read(folder, "weka", sessions=SessionStart("stagger", interval_s=2.0))
    assert_matches_brute_force(reqs, expand([(k[1], ids, n) for k, ids, n in (
        (("a", "big"), [1, 2], 9), (("b", "big"), [1, 2, 9], 12), (("a", "small"), [1, 2], 8),
        (("b", "big"), [1, 2], 9), (("a", "small"), [1, 2, 3], 13),
        (("a", "big"), [1, 2, 9], 14))]))
    # back_to_back: b starts when a's last request arrives.
    reqs = read(folder, "weka")
    assert sorted(r.arrival_s for r in reqs) == [0, 4.5, 7, 10, 10, 13]


def test_weka_jsonl_of_conversations_with_absolute_subagent_times(tmp_path, capsys):
    # SemiAnalysis' cc-traces-weka releases: traces.jsonl, a conversation a line, sub-agent
    # request `t` counted from the conversation's start (none is before its entry's `t`).
    convo = [{"t": 0, "type": "n", "model": "big", "in": 9, "out": 2, "hash_ids": [1, 2]},
             {"t": 100, "type": "subagent", "agent_id": "a", "status": "completed",
              "requests": [{"t": 101, "type": "n", "model": "big", "in": 8, "out": 1,
                            "hash_ids": [1, 2]}]},
             {"t": 150, "type": "n", "model": "big", "in": 14, "out": 2, "hash_ids": [1, 2, 9]}]
    path = write(tmp_path / "traces.jsonl", weka_doc("local", convo), weka_doc("local", convo))
    assert sniff(path)[0] == "weka"
    reqs = read(path, "auto")
    assert [(r.arrival_s, r.input_length) for r in reqs] == [
        (0, 9), (101, 8), (150, 14), (150, 9), (251, 8), (300, 14)]
    # Local scope: each line is its own namespace.
    reference = expand([(k, ids, n) for k, ids, n in (
        (0, [1, 2], 9), (0, [1, 2], 8), (0, [1, 2, 9], 14),
        (1, [1, 2], 9), (1, [1, 2], 8), (1, [1, 2, 9], 14))])
    assert_matches_brute_force(reqs, reference)
    bad_line = json.dumps(weka_doc("local", [{"t": 0, "type": "x"}]))
    path.write_text(json.dumps(weka_doc("local", convo)) + "\n" + bad_line + "\n")
    code, _, err = run_cli(["trace", "stats", path], capsys)
    assert code == 2 and err.strip().endswith(
        "traces.jsonl:2: 'type' must be one of \"n\", \"s\", \"subagent\", got \"x\"")


def test_weka_jsonl_lines_name_their_line_and_hold_one_value_each(tmp_path, capsys):
    """A JSONL line that is not a conversation names its own line (not line 1); two values on
    one line are refused (neither JSON nor JSONL), and an empty `.jsonl` is zero conversations
    (an empty `.json` is still no document)."""
    doc = json.dumps(weka_doc(requests=[WEKA_REQ]))
    path = tmp_path / "traces.jsonl"
    for second, where in (("[1, 2]", "2: expected a JSON object (one conversation), got an array"),
                          ("5", "2: expected a JSON object (one conversation), got a number")):
        path.write_text(f"{doc}\n{second}\n")
        code, _, err = run_cli(["trace", "stats", path, "--format", "weka"], capsys)
        assert code == 2 and err.strip() == f"kvbench: error: {path}:{where}"
    path.write_text(f"{doc} {doc}\n")
    code, _, err = run_cli(["trace", "stats", path, "--format", "weka"], capsys)
    assert code == 2 and err.strip() == (
        f"kvbench: error: {path}:1: invalid JSON at column {len(doc) + 2}: extra data after a "
        "value (one JSON value a line)")
    folder = tmp_path / "w"
    folder.mkdir()
    (folder / "a.jsonl").write_text("")
    (folder / "b.jsonl").write_text("\n\r\n")
    (folder / "c.json").write_text(json.dumps(weka_doc(requests=[WEKA_REQ]), indent=1))
    assert [r.input_length for r in read(folder, "weka")] == [9]
    (folder / "d.json").write_text("")
    code, _, err = run_cli(["trace", "stats", folder], capsys)
    assert code == 2 and err.strip() == (
        f"kvbench: error: {folder / 'd.json'}:1: invalid JSON at column 1: Expecting value")


def test_weka_unit_warning_once_for_the_whole_input(tmp_path):
    """'later lines not reported' holds across the conversations of a JSONL and a folder."""
    late = [bad(WEKA_REQ, t=2e11)]
    path = write(tmp_path / "traces.jsonl", *(weka_doc(requests=late) for _ in range(3)))
    with pytest.warns(TraceWarning) as caught:
        read(path, "weka", limit=1)
    assert [str(w.message) for w in caught] == [
        f"{path}:1: 't' 2e+11 looks like Unix time in milliseconds, but this format takes "
        "seconds (later lines not reported)"]



def test_weka_jsonl_objects_know_their_lines(tmp_path):
    """Each object's line comes from the bisected line starts (counting newlines from the top
    for each object was quadratic: a 2.7 MB traces.jsonl of 60,000 requests took 40 s, now
    about 1.5 s on the 2-core machine); every request object of every line names its line, blank
    lines and CRLF counted."""
    from kvbench.traffic.tracefile import load_located_json

    path = tmp_path / "traces.jsonl"
    path.write_text("".join(json.dumps(weka_doc(requests=[
        {**WEKA_REQ, "t": i, "hash_ids": [c, i]} for i in range(20)]))
        + ("\r\n\n" if c % 2 else "\n") for c in range(3000)))
    values = load_located_json(path, lines=True)
    want = [1 + c + c // 2 for c in range(3000)]  # a blank line after every odd one
    assert [line for line, _ in values] == want
    assert all(req.line == line for line, doc in values for req in doc["requests"])
    assert len(read(path, "weka")) == 60000

def test_token_ids_exact_sharing(tmp_path):
    prompts = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 9], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
    path = write(tmp_path / "t.jsonl", *({"task_id": i, "input_ids": p, "output_tokens": 2}
                                         for i, p in enumerate(prompts)))
    reqs = read(path, "token_ids")
    reference = [Request(i, 0.0, len(p), 1, tokens=np.array(p)) for i, p in enumerate(prompts)]
    assert_matches_brute_force(reqs, reference)
    assert all(r.arrival_s == 0 for r in reqs)


def test_lengths_csv_azure_and_burstgpt(tmp_path):
    azure = tmp_path / "azure.csv"
    azure.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                     "2023-11-16 18:15:46.6805900,374,44\n\n2023-11-16 18:15:50.5105900,396,109\n")
    reqs = read(azure, "lengths_csv")
    assert [(round(r.arrival_s, 6), r.input_length, r.output_length) for r in reqs] == [
        (0, 374, 44), (3.83, 396, 109)]
    burst = tmp_path / "burst.csv"
    burst.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                     "5,ChatGPT,472,18,490,Conversation log\n45.5,GPT-4,1087,0,1087,API log\n")
    reqs = read(burst, "lengths_csv")
    assert [(r.arrival_s, r.input_length, r.output_length) for r in reqs] == [
        (0, 472, 18), (40.5, 1087, 0)]
    refs = reference_hit_rates(reqs + [Request(2, 50, 472, 1, hash_ids=reqs[0].hash_ids + 0)][:0],
                               16, 1000, partial_reuse=True)
    assert refs.ideal_reused_tokens == 0


def test_lengths_csv_skips_and_counts_rows_without_prompt_tokens(tmp_path, capsys):
    """A logged call with no prompt tokens has nothing to prefill or cache: skipped, counted
    (trace stats), its time still ordered against its neighbours'."""
    burst = tmp_path / "burst.csv"
    burst.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                     "5,ChatGPT,472,18,490,Conversation log\n7,GPT-4,0,0,0,API log\n"
                     "9,GPT-4,30,2,32,API log\n")
    reader = open_trace(burst, "lengths_csv")
    assert [(r.arrival_s, r.input_length) for r in reader] == [(0, 472), (4, 30)]
    assert reader.without_prompt == 1 and reader.without_ids == 2
    code, out, _ = run_cli(["trace", "stats", burst, "--json", "-"], capsys)
    stats = json.loads(out)
    assert code == 0 and stats["records_without_prompt"] == 1 and stats["requests"] == 2
    burst.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                     "5,ChatGPT,472,18,490,Conversation log\n4,GPT-4,0,0,0,API log\n")
    code, _, err = run_cli(["trace", "stats", burst], capsys)
    assert code == 2 and "burst.csv:3: 'Timestamp' 4 is before the previous row's" in err
    burst.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                     "1_0,ChatGPT,472,18,490,Conversation log\n")
    code, _, err = run_cli(["trace", "stats", burst], capsys)
    assert code == 2 and err.strip() == (
        f"kvbench: error: {burst}:2: 'Timestamp' must be seconds or a date and time, got '1_0'")
    # Every row without prompt tokens: a run says why its stream is empty.
    burst.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                     "5,ChatGPT,0,0,0,Conversation log\n7,GPT-4,0,0,0,API log\n")
    workload = tmp_path / "w.yaml"
    workload.write_text("model: {num_layers: 2, num_kv_heads: 1, num_q_heads: 1, head_dim: 8}\n"
                        "requests: {source: trace, path: burst.csv}\nrun: {mode: serve}\n")
    for command in ("run", "validate"):
        code, _, err = run_cli([command, workload], capsys)
        assert code == 2 and err.strip().splitlines()[-1] == (
            f"kvbench: error: {workload}: requests: the request stream is empty (2 trace "
            "records skipped: no prompt tokens)"), command
    # Converted, it is empty: no block size to read it with (it said block_tokens: None).
    out = tmp_path / "out.jsonl"
    code, _, err = run_cli(["trace", "convert", burst, out], capsys)
    assert code == 0 and out.read_text() == "" and err.strip() == (
        f"wrote 0 requests to {out}; read it with requests.format: mooncake")

@pytest.mark.parametrize("stamp, micros, zoned", [
    ("2023-11-16 18:15:46.6805900", 680590, False), ("2023-11-16 18:15:46.68059", 680590, False),
    ("2023-11-16 18:15:46.1", 100000, False), ("2023-11-16T18:15:46.123Z", 123000, True),
    ("2023-11-16T18:15:46Z", 0, True), ("2023-11-16 18:15:46.5+01:00", 500000, True)])
def test_csv_dates_parse_alike_on_every_python(stamp, micros, zoned):
    """1 to 7 fractional digits and a Z for UTC, which Python 3.10's datetime refuses (it takes
    3 or 6 digits, no Z) and later ones take: the reader passes it 6 digits and +00:00."""
    from kvbench.traffic.lengths_csv import _timestamp

    ts = _timestamp(stamp, "TIMESTAMP")
    assert ts.microsecond == micros and (ts.tzinfo is not None) == zoned

def test_fresh_blocks_are_one_run_of_new_ids_within_the_bound():
    """A prompt without prefix ids takes ceil(length / block) ids nothing else has, the same
    ids one `fresh` call per block would give; past the id bound it is one bad-field error."""
    from kvbench.traffic.tracefile import MAX_DENSE_ID, BadField, ChainedIds

    table, one_by_one = ChainedIds(start=5), ChainedIds(start=5)
    for length, block in [(1, 16), (16, 16), (17, 16), (1000, 512), (3, 1)]:
        want = [one_by_one.fresh() for _ in range(-(-length // block))]
        assert table.fresh_blocks(length, block).tolist() == want
    assert table.fresh() == one_by_one.fresh()
    near = ChainedIds(start=MAX_DENSE_ID - 2)
    assert near.fresh_blocks(48, 16).tolist() == [MAX_DENSE_ID - 2, MAX_DENSE_ID - 1, MAX_DENSE_ID]
    with pytest.raises(BadField, match="distinct trace blocks"):
        ChainedIds(start=MAX_DENSE_ID - 2).fresh_blocks(49, 16)

# --- id remapping --------------------------------------------------------------------------------

raw_ids = st.one_of(st.integers(0, 3), st.integers(2**38 - 2, 2**38 + 1), st.integers(-2, 2**64),
                    st.sampled_from(["0", "1", "ff", "0x1", ""]))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(raw_ids, min_size=1, max_size=4), min_size=1, max_size=8))
def test_remapped_ids_never_collide(tmp_path_factory, prompts):
    """Equal dense ids exactly where the raw prefixes are equal, whatever the raw ids are."""
    tmp = tmp_path_factory.mktemp("ids")
    for fmt in ("bailian", "servegen"):
        rows = [{"chat_id": 0, "parent_chat_id": -1, "timestamp": 0, "type": "t", "turn": 0,
                 "request_id": 0, "input_length": len(p) * B, "output_length": 1,
                 "hash_ids": p} for p in prompts]
        reqs = read(write(tmp / f"{fmt}.jsonl", *rows), fmt, block_tokens=B)
        dense = {}
        for p, r in zip(prompts, reqs):
            for j, d in enumerate(r.hash_ids.tolist()):
                key = tuple(map(repr, p[:j + 1]))
                assert dense.setdefault(key, d) == d
        assert len(set(dense.values())) == len(dense)
    # Mooncake keeps small ids as they are and checks the chain instead; a chained trace of
    # mixed id types remaps without collisions.
    chained = [[("p", i, *map(repr, p[:j + 1])) for j in range(len(p))] for i, p in
               enumerate(prompts)]
    names: dict = {}
    rows = [{"timestamp": 0, "input_length": len(p) * B, "output_length": 1,
             "hash_ids": [_raw(names, k) for k in c]} for p, c in zip(prompts, chained)]
    reqs = read(write(tmp / "m.jsonl", *rows), "mooncake", block_tokens=B)
    flat = [d for r in reqs for d in r.hash_ids.tolist()]
    raw = [h for row in rows for h in row["hash_ids"]]
    assert len(set(flat)) == len(set(map(repr, raw)))


def _raw(names: dict, key) -> object:
    """A raw id per chained prefix, alternating types: small ints, big ints, hex strings."""
    n = names.setdefault(key, len(names))
    return [n, 2**63 + n, f"{n:x}", -n - 1][n % 4]


# --- bad input -----------------------------------------------------------------------------------

MOONCAKE_OK = {"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}
BAILIAN_OK = {"chat_id": 1, "parent_chat_id": -1, "timestamp": 0.5, "input_length": 20,
              "output_length": 1, "type": "text", "turn": 1, "hash_ids": [1, 2]}
SERVEGEN_OK = {"request_id": 1, "type": "text", "input_length": 20, "hash_ids": [1, 2],
               "img_ids": []}
TOKENS_OK = {"task_id": 1, "input_ids": [1, 2, 3], "output_tokens": 4}


def bad(base, **change):
    obj = {k: v for k, v in base.items() if k not in change or change[k] is not _DROP}
    obj.update({k: v for k, v in change.items() if v is not _DROP})
    return obj


_DROP = object()

JSONL_BAD = [
    ("mooncake", MOONCAKE_OK, dict(timestamp="1"), "'timestamp' must be a number (ms), got \"1\""),
    ("mooncake", MOONCAKE_OK, dict(timestamp=10**30), "'timestamp' must be at most 1e+15, got 1e+30"),
    ("mooncake", MOONCAKE_OK, dict(input_length=_DROP), "missing field 'input_length'"),
    ("mooncake", MOONCAKE_OK, dict(output_length=-1), "'output_length' must be in [0, 16777215], got -1"),
    ("mooncake", MOONCAKE_OK, dict(hash_ids=[1, [2]]),
     "'hash_ids' must hold integers or strings, got [2]"),
    ("bailian", BAILIAN_OK, dict(chat_id="x"), "'chat_id' must be an integer, got \"x\""),
    ("bailian", BAILIAN_OK, dict(parent_chat_id=-2),
     "'parent_chat_id' must be >= -1, got -2"),
    ("bailian", BAILIAN_OK, dict(timestamp=None), "'timestamp' must be a number (s), got null"),
    ("bailian", BAILIAN_OK, dict(timestamp=0.1), "timestamp 0.1 is before the previous "
                                                 "request's 0.5"),
    ("bailian", BAILIAN_OK, dict(input_length=0),
     "'input_length' must be in [1, 16777215], got 0"),
    ("bailian", BAILIAN_OK, dict(output_length=1.5), "'output_length' must be an integer, got 1.5"),
    ("bailian", BAILIAN_OK, dict(type=3), "'type' must be a string, got 3"),
    ("bailian", BAILIAN_OK, dict(turn=_DROP), "missing field 'turn'"),
    ("bailian", BAILIAN_OK, dict(hash_ids=[1]),
     "'hash_ids' has 1 ids, but input_length 20 needs 2 (blocks of 16 tokens); it fits "
     "requests.hash_ids_cover: floor"),
    ("servegen", SERVEGEN_OK, dict(request_id=[1]),
     "'request_id' must be an integer or a string, got [1]"),
    ("servegen", SERVEGEN_OK, dict(type=_DROP), "missing field 'type'"),
    ("servegen", SERVEGEN_OK, dict(input_length="20"),
     "'input_length' must be an integer, got \"20\""),
    ("servegen", SERVEGEN_OK, dict(hash_ids={"a": 1}),
     "'hash_ids' must be a list of integers or strings, got {\"a\": 1}"),
    ("servegen", SERVEGEN_OK, dict(img_ids=3),
     "'img_ids' must be a list of integers or strings, got 3"),
    ("servegen", SERVEGEN_OK, dict(img_ids=[1.5]),
     "'img_ids' must hold integers or strings, got 1.5"),
    ("token_ids", TOKENS_OK, dict(input_ids=[]), "'input_ids' must hold 1 to 16777215 tokens, got 0"),
    ("token_ids", TOKENS_OK, dict(input_ids=[1, -1]),
     "'input_ids' must hold integers in [0, 4611686018427387903], got -1"),
    ("token_ids", TOKENS_OK, dict(output_tokens=_DROP), "missing field 'output_tokens'"),
    ("token_ids", TOKENS_OK, dict(task_id=None), "'task_id' must be an integer or a string, got null"),
    ("token_ids", TOKENS_OK, dict(timestamp=5), "'timestamp' on a line of a trace whose first "
                                                "line has none: time every line, or none"),
]


@pytest.mark.parametrize("fmt, ok, change, message", JSONL_BAD,
                         ids=[f"{f}-{m[:40]}" for f, _, _, m in JSONL_BAD])
def test_jsonl_bad_field_exits_2_with_file_and_line(tmp_path, capsys, fmt, ok, change, message):
    path = write(tmp_path / "t.jsonl", ok, "", bad(ok, **change), ok)
    code, out, err = run_cli(["trace", "stats", path, "--format", fmt], capsys)
    assert code == 2
    assert err.strip() == f"kvbench: error: {path}:3: {message}"
    assert "Traceback" not in err + out


@pytest.mark.parametrize("fmt, ok", [("mooncake", MOONCAKE_OK), ("bailian", BAILIAN_OK),
                                     ("servegen", SERVEGEN_OK), ("token_ids", TOKENS_OK)])
def test_jsonl_not_json_or_not_utf8(tmp_path, capsys, fmt, ok):
    path = write(tmp_path / "t.jsonl", ok, "[1]")
    code, _, err = run_cli(["trace", "stats", path, "--format", fmt], capsys)
    assert code == 2 and err.strip().endswith(f"{path}:2: expected a JSON object, got an array")
    path.write_bytes(json.dumps(ok).encode() + b'\n{"x": "\xff"}\n')
    code, _, err = run_cli(["trace", "stats", path, "--format", fmt], capsys)
    assert code == 2 and err.strip().endswith(f"{path}:2: not UTF-8 text")


def test_integers_too_long_or_too_large_are_bad_input(tmp_path, capsys):
    """JSON integers have no size limit: one past float's range is a time too late, one past
    Python's str -> int digit limit is invalid JSON at its line and column, in every reader and
    while sniffing (both crashed with exit 1)."""
    digits = MAX_INT_DIGITS
    if not digits:
        pytest.skip("no digit limit in this Python")
    huge, endless = "1" + "0" * 400, "1" + "0" * digits
    cases = [
        ("m.jsonl", json.dumps(MOONCAKE_OK) + "\n" + json.dumps(MOONCAKE_OK).replace(
            '"timestamp": 0', f'"timestamp": {huge}'),
         f"2: 'timestamp' must be at most 1e+15, got {huge[:37]}..."),
        ("m.jsonl", '{"timestamp": 0, "input_length": %s, "output_length": 1}' % endless,
         f"1: invalid JSON at column 34: an integer of more than {digits} digits"),
        ("w.json", json.dumps(weka_doc(requests=[WEKA_REQ]), indent=1).replace(
            '"t": 0', f'"t": {huge}'), f"12: 't' must be at most 1e+15, got {huge[:37]}..."),
        ("w.json", json.dumps(weka_doc(requests=[WEKA_REQ]), indent=1).replace(
            '"in": 9', f'"in": {endless}'),
         f"16: invalid JSON at column 10: an integer of more than {digits} digits"),
        ("w.jsonl", json.dumps(weka_doc(requests=[WEKA_REQ])).replace(
            '"in": 9', f'"in": {huge}'), f"1: 'in' must be in [1, 16777215], got {huge[:37]}..."),
    ]
    for name, text, message in cases:
        path = tmp_path / name
        path.write_text(text + "\n")
        code, out, err = run_cli(["trace", "stats", path], capsys)
        assert (code, err.strip()) == (2, f"kvbench: error: {path}:{message}"), name


WEKA_REQ = {"t": 0, "type": "n", "model": "big", "in": 9, "out": 2, "hash_ids": [1, 2]}


def here(obj: dict) -> dict:
    """The bad object, marked so the test finds the line it starts on."""
    return {"at": "here", **obj}
WEKA_BAD = [
    (dict(block_size=0), 1, "'block_size' must be in [1, 1048576], got 0"),
    (dict(block_size=_DROP), 1, "missing field 'block_size'"),
    (dict(hash_id_scope="file"), 1, "'hash_id_scope' must be \"local\" or \"global\", got \"file\""),
    (dict(models="big"), 1, "'models' must be a list of strings, got \"big\""),
    (dict(system_tokens=-1), 1, "'system_tokens' must be >= 0, got -1"),
    (dict(requests={}), 1, "'requests' must be a list of request objects, got {}"),
    (dict(requests=[WEKA_REQ, 5]), 1, "'requests' must hold objects, got a number"),
    (dict(requests=[WEKA_REQ, here(bad(WEKA_REQ, t=-1))]), None, "'t' must be >= 0, got -1"),
    (dict(requests=[WEKA_REQ, here(bad(WEKA_REQ, type="x"))]), None,
     "'type' must be one of \"n\", \"s\", \"subagent\", got \"x\""),
    (dict(requests=[WEKA_REQ, here(bad(WEKA_REQ, model="huge"))]), None,
     "'model' \"huge\" is not one of the file's 'models'"),
    (dict(requests=[WEKA_REQ, here(bad(WEKA_REQ, **{"in": 0}))]), None,
     "'in' must be in [1, 16777215], got 0"),
    (dict(requests=[WEKA_REQ, here(bad(WEKA_REQ, out=_DROP))]), None, "missing field 'out'"),
    (dict(requests=[WEKA_REQ, here(bad(WEKA_REQ, hash_ids=[1, 2, 3]))]), None,
     "'hash_ids' has 3 ids, but input_length 9 needs 2 (blocks of 4 tokens, full blocks only: "
     "hash_ids_cover floor); it fits requests.hash_ids_cover: ceil"),
    (dict(requests=[WEKA_REQ, {"t": 1, "type": "subagent",
                               "requests": [here(bad(WEKA_REQ, t="1"))]}]), None, "'t' must be a number (s), got \"1\""),
    (dict(requests=[WEKA_REQ, here({"t": 1, "type": "subagent"})]), None,
     "missing field 'requests'"),
    (dict(requests=[WEKA_REQ, here(bad(WEKA_REQ, t=1e308))]), None,
     "'t' must be at most 1e+15, got 1e+308"),
]


@pytest.mark.parametrize("change, line, message", WEKA_BAD, ids=[m[:50] for _, _, m in WEKA_BAD])
def test_weka_bad_field_exits_2_with_file_and_line(tmp_path, capsys, change, line, message):
    folder = tmp_path / "w"
    folder.mkdir()
    (folder / "a.json").write_text(json.dumps(weka_doc(requests=[WEKA_REQ]), indent=1))
    doc = bad(weka_doc(requests=[WEKA_REQ]), **change)
    text = json.dumps(doc, indent=1)
    (folder / "b.json").write_text(text)
    if line is None:
        line = next(i for i, t in enumerate(text.splitlines()) if '"at": "here"' in t)
    code, out, err = run_cli(["trace", "stats", folder, "--format", "weka"], capsys)
    assert code == 2
    assert err.strip() == f"kvbench: error: {folder / 'b.json'}:{line}: {message}"
    assert "Traceback" not in err + out


def test_weka_block_size_must_agree_and_bad_json(tmp_path, capsys):
    folder = tmp_path / "w"
    folder.mkdir()
    (folder / "a.json").write_text(json.dumps(weka_doc(requests=[WEKA_REQ])))
    (folder / "b.json").write_text(json.dumps(weka_doc(requests=[WEKA_REQ], block=8)))
    code, _, err = run_cli(["trace", "stats", folder], capsys)
    assert code == 2 and err.strip().endswith(
        f"b.json:1: 'block_size' 8 differs from 4 (the folder's earlier files): one trace has "
        "one block size")
    (folder / "b.json").write_text('{\n "id": "c",\n "requests": [\n')
    code, _, err = run_cli(["trace", "stats", folder], capsys)
    assert code == 2 and f"{folder / 'b.json'}:4: invalid JSON at column 1" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = run_cli(["trace", "stats", empty], capsys)
    assert code == 2 and "no .json conversation files in this folder" in err


CSV_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
CSV_OK = "2023-11-16 18:15:46.6805900,374,44\n"
CSV_BAD = [
    ("2023-13-16 18:15:46,374,44", "'TIMESTAMP' must be seconds or a date and time, got "
                                   "'2023-13-16 18:15:46'"),
    ("2023-11-16 18:15:47,-1,44", "'ContextTokens' must be in [0, 16777215], got -1"),
    ("2023-11-16 18:15:47,374,4.5", "'GeneratedTokens' must be an integer, got '4.5'"),
    ("2023-11-16 18:15:47,374", "expected at least 3 columns, got 2"),
    ("2023-11-16 18:15:40,374,44", "'TIMESTAMP' 2023-11-16 18:15:40 is before the previous row's"),
    ("2023-11-16 18:15:47+00:00,374,44", "'TIMESTAMP' '2023-11-16 18:15:47+00:00': expected a "
                                         "date and time without a zone like the rows before"),
    ("1e300,374,44", "'TIMESTAMP' must be a number of seconds in [0, 1e+15], got '1e300'"),
    # int() and float() take digit groups and non-ASCII digits (read as 374, 12 and 10 s).
    ("2023-11-16 18:15:47,3_74,44", "'ContextTokens' must be an integer, got '3_74'"),
    ("2023-11-16 18:15:47,374,\u0661\u0662", "'GeneratedTokens' must be an integer, got "
                                               "'\u0661\u0662'"),
    ("2023-11-16 18:15:47," + "9" * 5000 + ",44",
     "'ContextTokens' must be in [0, 16777215], got " + "9" * 37 + "..."),
]


@pytest.mark.parametrize("row, message", CSV_BAD, ids=[m[:40] for _, m in CSV_BAD])
def test_csv_bad_field_exits_2_with_file_and_line(tmp_path, capsys, row, message):
    path = tmp_path / "t.csv"
    path.write_text(CSV_HEADER + CSV_OK + row + "\n" + CSV_OK)
    code, out, err = run_cli(["trace", "stats", path, "--format", "lengths_csv"], capsys)
    assert code == 2 and err.strip() == f"kvbench: error: {path}:3: {message}"
    assert "Traceback" not in err + out


def test_csv_zones_seven_digits_bom_and_the_line_of_a_bad_byte(tmp_path, capsys):
    """Azure's seven fractional digits may carry a zone after them; a BOM before the header is
    dropped; a byte that is not UTF-8 is reported on its own line (not where decoding ahead
    happened to meet it)."""
    path = tmp_path / "t.csv"
    path.write_bytes(("\ufeff" + CSV_HEADER + "2023-11-16 18:15:46.6805900+01:00,374,44\n"
                      "2023-11-16T17:15:47.1000000Z,10,1\n").encode())
    assert [r.arrival_s for r in read(path, "lengths_csv")] == pytest.approx([0.0, 0.4194100])
    path.write_bytes(CSV_HEADER.encode() + CSV_OK.encode() * 2 + b"2023-11-16 18:15:47,3\xff4,4\n")
    code, _, err = run_cli(["trace", "stats", path], capsys)
    assert code == 2 and err.strip() == f"kvbench: error: {path}:4: not UTF-8 text"


@pytest.mark.parametrize(("compress", "suffix"), [("gzip", "gz"), ("bz2", "bz2"), ("lzma", "xz")])
def test_compressed_traces_read_as_the_plain_one(tmp_path, capsys, compress, suffix):
    """A gzip, bzip2 or xz trace is read as its plain text, whatever its name (a weka folder
    takes `*.json.gz` and the like too); a truncated one is bad input naming the file."""
    import importlib
    opener = importlib.import_module(compress).open
    samples = write_samples(tmp_path)
    plain = samples["mooncake"]
    packed = tmp_path / "m.packed"
    with opener(packed, "wb") as f:
        f.write(plain.read_bytes())
    assert sniff(packed) == sniff(plain)
    want = [(r.arrival_s, r.input_length, r.hash_ids.tolist()) for r in read(plain, "auto")]
    assert [(r.arrival_s, r.input_length, r.hash_ids.tolist())
            for r in read(packed, "auto")] == want
    folder = tmp_path / "w"
    folder.mkdir()
    doc = json.dumps(weka_doc(requests=[WEKA_REQ]))
    (folder / "a.json").write_text(doc)
    with opener(folder / f"b.json.{suffix}", "wt") as f:
        f.write(doc)
    assert len(read(folder, "weka")) == 2
    packed.write_bytes(packed.read_bytes()[:-12])
    code, _, err = run_cli(["trace", "stats", packed, "--format", "mooncake"], capsys)
    assert code == 2 and err.startswith(f"kvbench: error: {packed}: damaged ")
    assert len(err.strip().splitlines()) == 1


def test_arrivals_past_the_bound_after_time_scale(tmp_path, capsys):
    """Times that fit their field can still pass the latest arrival once scaled (serve mode
    keeps int64 microseconds): the request is named."""
    path = write(tmp_path / "m.jsonl", MOONCAKE_OK, bad(MOONCAKE_OK, timestamp=1e15))
    assert read(path, "mooncake")[1].arrival_s == 1e12
    with pytest.raises(InputError, match=r"m.jsonl: request 2 arrives at 1e\+16 s \(after "
                       r"requests.time_scale 10000\); arrivals must be at most 4e\+12 s"):
        read(path, "mooncake", time_scale=1e4)


def test_deep_nesting_is_bad_input(tmp_path, capsys):
    """Subagents nest at most 64 deep, and JSON nested past Python's recursion limit is bad
    input, not a RecursionError."""
    folder = tmp_path / "w"
    folder.mkdir()
    doc = weka_doc(requests=[WEKA_REQ])
    node = doc
    for _ in range(65):
        sub = {"t": 0, "type": "subagent", "requests": [WEKA_REQ]}
        node["requests"] = node["requests"] + [sub]
        node = sub
    (folder / "b.json").write_text(json.dumps(doc))
    code, _, err = run_cli(["trace", "stats", folder, "--format", "weka"], capsys)
    assert code == 2 and err.strip() == (f"kvbench: error: {folder / 'b.json'}:1: subagents "
                                         "nested deeper than 64 levels")
    (folder / "b.json").write_text('{"requests": ' + "[" * 100000 + "]" * 100000 + "}")
    code, _, err = run_cli(["trace", "stats", folder, "--format", "weka"], capsys)
    assert code == 2 and err.strip() == (f"kvbench: error: {folder / 'b.json'}: JSON nested "
                                         "too deeply for a trace file")
    path = tmp_path / "m.jsonl"
    path.write_text('{"hash_ids": ' + "[" * 100000 + "]" * 100000 + "}\n")
    code, _, err = run_cli(["trace", "stats", path, "--format", "mooncake"], capsys)
    assert code == 2 and err.strip() == (f"kvbench: error: {path}:1: JSON nested too deeply "
                                         "for a trace record")


def test_csv_unknown_header(tmp_path, capsys):
    path = tmp_path / "t.csv"
    path.write_text("time,prompt,answer\n1,2,3\n")
    code, _, err = run_cli(["trace", "stats", path, "--format", "lengths_csv"], capsys)
    assert code == 2 and f"{path}:1: expected a header with the columns of Azure" in err


# --- sniffing, warnings, stats, convert ----------------------------------------------------------


def test_auto_sniffs_every_sample_and_explains_a_mismatch(tmp_path, capsys):
    samples = write_samples(tmp_path)
    for fmt, path in samples.items():
        assert sniff(path)[0] == fmt
    weka_file = next(samples["weka"].iterdir())
    code, _, err = run_cli(["trace", "stats", weka_file, "--format", "mooncake"], capsys)
    assert code == 2
    assert err.strip().endswith("; the file looks like a kv-cache-tester trace (`requests`, "
                                "`block_size: 64`): set requests.format: weka")
    code, _, err = run_cli(["trace", "stats", samples["bailian"], "--format", "mooncake"], capsys)
    assert code == 2 and err.strip().endswith(
        "; the file looks like a Bailian trace (`chat_id`, `parent_chat_id`): set "
        "requests.format: bailian")
    code, _, err = run_cli(["trace", "stats", samples["weka"], "--format", "mooncake"], capsys)
    assert code == 2 and "is a directory (only requests.format: weka reads a folder)" in err
    (tmp_path / "x.txt").write_text("hello\n")
    code, _, err = run_cli(["trace", "stats", tmp_path / "x.txt"], capsys)
    assert code == 2 and "cannot tell the trace format from the first record" in err



def test_a_request_id_with_aiperf_times_is_mooncake_not_servegen(tmp_path):
    """ServeGen has no times; an AIPerf Mooncake record with a `request_id` times itself with
    `delay` or `session_id` in place of `timestamp`, and sniffing it as ServeGen refused it
    ('missing field type')."""
    for times in ({"timestamp": 0}, {"delay": 0}, {"session_id": "s1"},
                  {"session_id": "s1", "delay": 5}):
        record = {"request_id": "r0", **times, "input_length": 600, "output_length": 1}
        path = write(tmp_path / "m.jsonl", record, {**record, "request_id": "r1"})
        assert sniff(path)[0] == "mooncake", times
        assert [r.input_length for r in read(path, "auto")] == [600, 600]
    stat = {"request_id": 0, "type": "text", "input_length": 600, "output_length": 1,
            "duration": 10}
    assert sniff(write(tmp_path / "s.jsonl", stat))[0] == "servegen"


def test_a_first_line_longer_than_the_sniffed_bytes_is_still_sniffed(tmp_path):
    """Sniffing reads 64 KiB; a first JSONL line past them (a traces.jsonl conversation of a
    few thousand requests, a prompt of 20,000 ids) was 'cannot tell the trace format'."""
    convo = weka_doc(requests=[{**WEKA_REQ, "t": i} for i in range(1000)])
    path = write(tmp_path / "traces.jsonl", convo, convo)
    assert sniff(path)[0] == "weka" and len(read(path, "auto")) == 2000
    record = {"timestamp": 0, "input_length": 512 * 20000, "output_length": 1,
              "hash_ids": list(range(20000))}
    path = write(tmp_path / "m.jsonl", record, record)
    assert sniff(path)[0] == "mooncake" and len(read(path, "auto")) == 2

def test_unit_warnings_name_the_line(tmp_path):
    path = write(tmp_path / "m.jsonl", MOONCAKE_OK, bad(MOONCAKE_OK, timestamp=1.7e9),
                 bad(MOONCAKE_OK, timestamp=1.8e9))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        read(path, "mooncake")
    (w,) = [w for w in caught if issubclass(w.category, TraceWarning)]
    assert str(w.message) == (f"{path}:2: 'timestamp' 1.7e+09 looks like Unix time in seconds, "
                              "but this format takes milliseconds (later lines not reported)")
    path = write(tmp_path / "b.jsonl", bad(BAILIAN_OK, timestamp=1.7e12))
    with pytest.warns(TraceWarning, match=r"b.jsonl:1: 'timestamp' 1.7e\+12 looks like Unix "
                      "time in milliseconds, but this format takes seconds"):
        read(path, "bailian")


def test_stats_native_block_and_resolvability(tmp_path, capsys):
    samples = write_samples(tmp_path)
    reader = open_trace(samples["bailian"])
    stats = trace_stats(list(reader), (8, 16, 64), reader=reader)
    assert stats["native_block_tokens"] == 16 and stats["convention"] == "ceil"
    assert stats["ideal_resolvable"] == {8: False, 16: True, 64: True}
    out_json = tmp_path / "s.json"
    code, out, _ = run_cli(["trace", "stats", samples["mooncake"], "--json", out_json], capsys)
    assert code == 0 and "512 tokens/id" in out and "(not resolvable)" in out
    saved = json.loads(out_json.read_text())
    assert saved["native_block_tokens"] == 512 and saved["ideal_resolvable"]["512"] is True
    assert saved["ideal_resolvable"]["64"] is False
    code, out, _ = run_cli(["trace", "stats", samples["lengths_csv"]], capsys)
    assert code == 0 and "none (no prefix information)" in out


def test_convert_round_trips(tmp_path, capsys):
    samples = write_samples(tmp_path)
    for fmt in ("bailian", "weka", "servegen"):
        out = tmp_path / f"{fmt}.mooncake.jsonl"
        code, _, err = run_cli(["trace", "convert", samples[fmt], out], capsys)
        assert code == 0, err
        block = {"weka": 64}.get(fmt, 16)
        assert f"requests.format: mooncake, requests.block_tokens: {block}" in err
        original = read(samples[fmt], fmt)
        again = read(out, "mooncake", block_tokens=block)
        for tpb in (block, 64):
            a = reference_hit_rates(original, tpb, 300, partial_reuse=True)
            b = reference_hit_rates(again, tpb, 300, partial_reuse=True)
            assert a == b
    out = tmp_path / "tokens.mooncake.jsonl"
    code, _, err = run_cli(["trace", "convert", samples["token_ids"], out,
                            "--out-block-tokens", "16"], capsys)
    assert code == 0, err
    a = reference_hit_rates(read(samples["token_ids"], "token_ids"), 16, 300, partial_reuse=False)
    b = reference_hit_rates(read(out, "mooncake", block_tokens=16), 16, 300, partial_reuse=False)
    assert a == b
    out = tmp_path / "bailian.tokens.jsonl"
    code, _, err = run_cli(["trace", "convert", samples["bailian"], out, "--to", "token_ids"],
                           capsys)
    assert code == 0, err
    a = reference_hit_rates(read(samples["bailian"], "bailian"), 16, 300, partial_reuse=True)
    b = reference_hit_rates(read(out, "token_ids"), 16, 300, partial_reuse=True)
    assert a == b


# --- workloads -----------------------------------------------------------------------------------

FORMAT_WORKLOADS = sorted((ROOT / "workloads" / "formats").glob("*.yaml"))


@pytest.fixture(scope="module")
def sample_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("formats")
    write_samples(folder / "samples")
    return folder


@pytest.mark.parametrize("workload", FORMAT_WORKLOADS, ids=[p.stem for p in FORMAT_WORKLOADS])
def test_format_workload_runs_on_its_sample(sample_dir, capsys, workload):
    copy = sample_dir / workload.name
    shutil.copy(workload, copy)
    out = sample_dir / f"{workload.stem}.json"
    code, _, err = run_cli(["run", copy, "--quiet", "--json", out], capsys)
    assert code == 0, err
    (run,) = json.loads(out.read_text())["runs"]
    m = run["metrics"]
    assert m["requests"] == 24
    if workload.stem == "lengths_csv":
        # Serve mode on arrivals and lengths only.
        assert run["config"]["run"]["mode"] == "serve"
        assert m["output_tokens"] > 0 and m["ttft_ms"]["p50"] > 0 and m["hit_rate"] == 0
    else:
        assert 0.3 < m["hit_rate"] <= m["ideal_hit_rate"] < 1


def test_cache_mode_on_lengths_only_says_so(sample_dir, capsys):
    copy = sample_dir / "lengths_csv.yaml"
    shutil.copy(ROOT / "workloads" / "formats" / "lengths_csv.yaml", copy)
    code, _, err = run_cli(["run", copy, "--quiet", "--set", "run.mode=cache"], capsys)
    assert code == 0, err
    assert err.count("kvbench: warning:") == 1
    assert "the trace has no prefix information" in err
