import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from kvbench.errors import InputError
from kvbench.traffic import Request, generate, load_requests, read_mooncake, trace_stats

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"
CONVERSATION = TRACES / "mooncake_conversation_trace.jsonl"
SYNTHETIC = TRACES / "mooncake_synthetic_trace.jsonl"
needs_traces = pytest.mark.skipif(not CONVERSATION.exists(), reason="shared traces absent")


def line(ts=1000, inp=600, out=10, ids=[0, 1], **extra) -> str:
    return json.dumps(
        {"timestamp": ts, "input_length": inp, "output_length": out, "hash_ids": ids, **extra}
    )


def write(tmp_path, *lines, name="t.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(f"{x}\n" for x in lines))
    return path


# --- real traces ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def conversation():
    return list(read_mooncake(CONVERSATION))


@needs_traces
def test_real_traces_load(conversation):
    synthetic = list(read_mooncake(SYNTHETIC))
    for reqs, n, span in ((conversation, 12_031, 3_537), (synthetic, 3_993, 1_022)):
        assert len(reqs) == n
        assert [r.id for r in reqs] == list(range(n))
        arrivals = np.array([r.arrival_s for r in reqs])
        assert np.all(np.diff(arrivals) >= 0)
        assert round(arrivals[-1] - arrivals[0]) == span
        assert all(r.hash_ids.dtype == np.int64 and r.trace_block_tokens == 512 for r in reqs)


@needs_traces
def test_real_trace_ideal_hit_rates(conversation):
    stats = trace_stats(conversation)
    assert stats["requests"] == 12_031
    assert stats["ideal_hit_rate"][512] == pytest.approx(0.373, abs=0.001)
    rates = [stats["ideal_hit_rate"][bs] for bs in (16, 32, 64, 128, 256, 512)]
    assert rates == sorted(rates, reverse=True)
    assert trace_stats(list(read_mooncake(SYNTHETIC)))["ideal_hit_rate"][512] == pytest.approx(
        0.650, abs=0.001
    )


@needs_traces
def test_trace_fast_path_matches_block_key_sets(conversation):
    # With a namespace, trace_stats falls back to sets of Request.block_keys: both must agree.
    head = conversation[:1500]
    salted = [
        Request(r.id, r.arrival_s, r.input_length, r.output_length, hash_ids=r.hash_ids,
                namespace="x")
        for r in head
    ]
    sizes = (64, 100, 512)
    assert trace_stats(head, sizes)["ideal_hit_rate"] == trace_stats(salted, sizes)["ideal_hit_rate"]


@needs_traces
def test_real_requests_share_exactly_their_shared_blocks(conversation):
    a, b = conversation[0], conversation[1]
    assert a.hash_ids[0] == b.hash_ids[0] and a.hash_ids[1] != b.hash_ids[1]
    assert_shared_tokens(a, b, 512)


# --- tokens and keys from hash ids ---------------------------------------------------------------


def trace_request(ids, length):
    return Request(0, 0.0, length, 1, hash_ids=np.array(ids, dtype=np.int64))


def assert_shared_tokens(a: Request, b: Request, shared: int):
    ta, tb = a.prompt_tokens(), b.prompt_tokens()
    assert np.array_equal(ta[:shared], tb[:shared])
    n = min(len(ta), len(tb))
    assert np.all(ta[shared:n] != tb[shared:n])
    for tpb in (64, 100, 1024):
        ka, kb = a.block_keys(tpb), b.block_keys(tpb)
        same = shared // tpb
        assert ka[:same] == kb[:same]
        assert all(x != y for x, y in zip(ka[same:], kb[same:]))


def test_tokens_shared_up_to_last_shared_block():
    a = trace_request([1, 2, 3, 6, 7], 2100)
    b = trace_request([1, 2, 4, 5, 8, 9], 2600)
    assert_shared_tokens(a, b, 1024)


def test_partial_last_block_shares_up_to_shorter_prompt():
    a = trace_request([1, 2, 3, 6, 7], 2100)
    c = trace_request([1, 2, 3], 1200)
    assert np.array_equal(a.prompt_tokens(0, 1200), c.prompt_tokens())
    for tpb in (64, 100, 1024):
        assert a.block_keys(tpb)[: 1200 // tpb] == c.block_keys(tpb)


def test_different_ids_never_share_tokens():
    a = trace_request([1, 2], 1024)
    b = trace_request([3, 4], 1024)
    assert not set(a.prompt_tokens().tolist()) & set(b.prompt_tokens().tolist())


# --- Mooncake reader -----------------------------------------------------------------------------


def test_reader_fields_ids_and_blank_lines(tmp_path):
    path = write(tmp_path, line(ts=1500), "", "   ", line(ts=2500, inp=512, out=0, ids=[0]))
    reqs = list(read_mooncake(path, time_scale=2.0))
    assert [r.id for r in reqs] == [0, 1]
    assert [r.arrival_s for r in reqs] == [3.0, 5.0]
    assert [(r.input_length, r.output_length) for r in reqs] == [(600, 10), (512, 0)]
    assert reqs[0].hash_ids.tolist() == [0, 1] and reqs[0].hash_ids.dtype == np.int64


def test_reader_limit_stops_before_bad_lines(tmp_path):
    path = write(tmp_path, line(), line(), "garbage")
    assert len(list(read_mooncake(path, limit=2))) == 2
    assert list(read_mooncake(path, limit=0)) == []


BAD_LINES = [
    ("{not json", "invalid JSON at column 2: Expecting property name enclosed in double quotes"),
    ('{"timestamp": 0', "invalid JSON at column 16: Expecting ',' delimiter"),
    ("[1, 2]", "expected a JSON object, got an array"),
    ('"text"', "expected a JSON object, got a string"),
    ('{"input_length": 1, "output_length": 1, "hash_ids": [0]}', "missing field 'timestamp'"),
    ('{"timestamp": 0, "output_length": 1, "hash_ids": [0]}', "missing field 'input_length'"),
    ('{"timestamp": 0, "input_length": 1, "hash_ids": [0]}', "missing field 'output_length'"),
    (line(ts="5"), "'timestamp' must be a number (ms), got \"5\""),
    (line(ts=True), "'timestamp' must be a number (ms), got true"),
    (line(ts=float("nan")), "'timestamp' must be a number (ms), got NaN"),
    (line(ts=-1), "'timestamp' must be >= 0, got -1"),
    (line(ts=999), "timestamp 999 is before the previous request's 1000"),
    (line(inp=600.0), "'input_length' must be an integer, got 600.0"),
    (line(inp=None), "'input_length' must be an integer, got null"),
    (line(out="7"), "'output_length' must be an integer, got \"7\""),
    (line(inp=0, ids=[]), "'input_length' must be in [1, 16777215], got 0"),
    (line(inp=-3, ids=[]), "'input_length' must be in [1, 16777215], got -3"),
    (line(out=-1), "'output_length' must be in [0, 16777215], got -1"),
    (line(ids=7), "'hash_ids' must be a list of integers or strings, got 7"),
    (line(ids=[0]), "'hash_ids' has 1 ids, but input_length 600 needs 2 (blocks of 512 tokens)"
                    "; it fits requests.hash_ids_cover: floor"),
    (line(inp=512), "'hash_ids' has 2 ids, but input_length 512 needs 1 (blocks of 512 tokens)"),
    (line(ids=[0, 1.0]), "'hash_ids' must hold integers or strings, got 1.0"),
    (line(ids=[0, True]), "'hash_ids' must hold integers or strings, got true"),
    (line(ids=[0, None]), "'hash_ids' must hold integers or strings, got null"),
    (line(ids=[0, 1], delay=5), "'delay' and 'timestamp' on one line: give one of them"),
    (line(ids=[5, 1]), "hash id 1 follows 5 here but 0 earlier (ids must be prefix-chained)"),
    (line(ids=[1, 9]), "hash id 1 follows nothing (first block) here but 0 earlier "
                       "(ids must be prefix-chained)"),
    (line(ids=[0, 0]), "hash id 0 follows 0 here but nothing (first block) earlier "
                       "(ids must be prefix-chained)"),
    (line(ids=[2**37, 1]), "hash id 1 follows 137438953472 here but 0 earlier "
                           "(ids must be prefix-chained)"),
    (line(ids=["x", 1]), "hash id 1 follows \"x\" here but 0 earlier (ids must be prefix-chained)"),
]


@pytest.mark.parametrize("bad, message", BAD_LINES, ids=[m for _, m in BAD_LINES])
def test_reader_rejects_bad_line_with_file_and_line(tmp_path, bad, message):
    path = write(tmp_path, line(), "", bad, line(ts=2000))
    with pytest.raises(InputError) as info:
        list(read_mooncake(path))
    assert str(info.value) == f"{path}:3: {message}"


def test_reader_rejects_non_utf8(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_bytes(line().encode() + b'\n{"timestamp": "\xff"}\n')
    with pytest.raises(InputError, match=r":2: not UTF-8 text$"):
        list(read_mooncake(path))


def test_reader_chain_check_beyond_the_dense_table(tmp_path):
    """Sparse ids (kept in a dict beside the dense table) are checked the same way, and the
    table grows over ids the dict held."""
    path = write(tmp_path, line(ids=[2**37, 7]), line(ids=[2**37, 7, 3], inp=1100),
                 line(ids=[200_000, 2**37], inp=1000))
    with pytest.raises(InputError, match=r":3: hash id 137438953472 follows 200000 here but "
                       r"nothing \(first block\) earlier"):
        list(read_mooncake(path))
    dense = [line(ts=i + 1, ids=[i, i + 1], inp=1000) for i in range(0, 300_000, 50_000)]
    path = write(tmp_path, line(ts=0, ids=[2**36, 70_000], inp=1000), *dense,
                 line(ts=10**6, ids=[5, 70_000], inp=1000))
    with pytest.raises(InputError, match=r":8: hash id 70000 follows 5 here but 68719476736 "):
        list(read_mooncake(path))


def test_reader_accepts_extra_fields_and_equal_timestamps(tmp_path):
    path = write(tmp_path, line(ts=5, session="a"), line(ts=5))
    assert len(list(read_mooncake(path))) == 2


def test_reader_missing_file(tmp_path):
    path = tmp_path / "nope.jsonl"
    with pytest.raises(InputError) as info:
        read_mooncake(path)
    assert str(info.value) == f"{path}: cannot read trace: No such file or directory"


# --- synthetic traffic ---------------------------------------------------------------------------


def synth(**kw):
    cfg = dict(
        generator="shared_prefix", num_requests=200, system_prompt_tokens=64, prompt_tokens=40,
        prompt_tokens_spread=0.5, output_tokens=20, num_users=4, turns=3, arrival="poisson",
        rate=10.0, vocab_size=1000,
    )
    cfg.update(kw)
    return SimpleNamespace(**cfg)


def fingerprint(reqs):
    return [
        (r.id, r.arrival_s, r.output_length, r.tokens.tolist(),
         None if r.output_tokens is None else r.output_tokens.tolist())
        for r in reqs
    ]


@pytest.mark.parametrize("generator", ["shared_prefix", "multi_turn"])
def test_synthetic_is_deterministic_per_seed(generator):
    cfg = synth(generator=generator)
    assert fingerprint(generate(cfg, 1)) == fingerprint(generate(cfg, 1))
    assert fingerprint(generate(cfg, 1)) != fingerprint(generate(cfg, 2))


@pytest.mark.parametrize("generator", ["shared_prefix", "multi_turn"])
def test_synthetic_ids_order_and_tokens(generator):
    reqs = generate(synth(generator=generator), 0)
    assert [r.id for r in reqs] == list(range(200))
    arrivals = np.array([r.arrival_s for r in reqs])
    assert arrivals[0] > 0 and np.all(np.diff(arrivals) > 0)
    assert 7 < len(reqs) / arrivals[-1] < 13
    for r in reqs:
        assert r.tokens.dtype == np.int64 and len(r.tokens) == r.input_length
        assert r.tokens.min() >= 0 and r.tokens.max() < 1000
        assert 10 <= r.output_length <= 30


def test_burst_arrivals_all_at_zero():
    reqs = generate(synth(arrival="burst"), 0)
    assert [r.arrival_s for r in reqs] == [0.0] * 200
    assert [r.id for r in reqs] == list(range(200))


def test_shared_prefix_structure():
    reqs = generate(synth(num_requests=300), 3)
    system = reqs[0].tokens[:64]
    assert all(np.array_equal(r.tokens[:64], system) for r in reqs)
    profiles = {r.tokens[64:104].tobytes() for r in reqs}
    assert len(profiles) == 4
    assert all(20 <= r.input_length - 104 <= 60 for r in reqs)
    assert all(r.output_tokens is None for r in reqs)


def sessions(reqs):
    """Chains of turns: each request's previous turn is an earlier prompt + answer it extends."""
    chains = []
    for r in reqs:
        for chain in chains:
            last = chain[-1]
            context = np.concatenate([last.tokens, last.output_tokens])
            if len(context) < r.input_length and np.array_equal(r.tokens[: len(context)], context):
                chain.append(r)
                break
        else:
            chains.append([r])
    return chains


@pytest.mark.parametrize(
    "num_requests, num_users, turns, expected_sessions",
    [(60, 4, 3, 20), (10, 4, 5, None)],
)
def test_multi_turn_sessions(num_requests, num_users, turns, expected_sessions):
    cfg = synth(generator="multi_turn", num_requests=num_requests, num_users=num_users,
                turns=turns)
    reqs = generate(cfg, 5)
    assert len(reqs) == num_requests
    chains = sessions(reqs)
    if expected_sessions is None:
        assert len(chains) <= num_users
    else:
        assert len(chains) == expected_sessions
    assert all(len(c) <= turns for c in chains)
    for chain in chains:
        first = chain[0]
        assert 20 <= first.input_length - 64 <= 60
        for prev, cur in zip(chain, chain[1:]):
            assert len(prev.output_tokens) == prev.output_length
            assert prev.output_tokens.dtype == np.int64
            context = np.concatenate([prev.tokens, prev.output_tokens])
            assert np.array_equal(cur.tokens[: len(context)], context)
            assert 20 <= cur.input_length - len(context) <= 60
            assert cur.arrival_s > prev.arrival_s


def test_multi_turn_keeps_num_users_sessions_in_flight():
    reqs = generate(synth(generator="multi_turn", num_requests=400, num_users=8, turns=50), 0)
    assert len(sessions(reqs)) == 8


# --- load_requests -------------------------------------------------------------------------------


def requests_cfg(**kw):
    cfg = dict(source="synthetic", synthetic=synth(), limit=None, skip=0, time_scale=1.0,
               format="mooncake", path=None, block_tokens=None, hash_ids_cover=None,
               sessions=SimpleNamespace(start="back_to_back", interval_s=None, rate=None,
                                        turn_interval_s=30.0),
               output_length=128, tokenizer="approx")
    cfg.update(kw)
    return SimpleNamespace(**cfg)


def test_load_synthetic_applies_limit_and_time_scale(tmp_path):
    full = generate(synth(), 7)
    reqs = load_requests(requests_cfg(limit=50, time_scale=0.5), base_dir=tmp_path, seed=7)
    assert [r.id for r in reqs] == list(range(50))
    assert [r.arrival_s for r in reqs] == [r.arrival_s * 0.5 for r in full[:50]]


def test_load_trace_relative_to_base_dir(tmp_path):
    write(tmp_path, line(ts=1000), line(ts=3000), line(ts=4000), name="tr.jsonl")
    cfg = requests_cfg(source="trace", path="tr.jsonl", limit=2, time_scale=0.1)
    reqs = load_requests(cfg, base_dir=tmp_path, seed=0)
    assert [r.arrival_s for r in reqs] == pytest.approx([0.1, 0.3])


def test_load_unknown_format(tmp_path):
    with pytest.raises(InputError, match="unknown trace format 'sharegpt'"):
        load_requests(requests_cfg(source="trace", format="sharegpt", path="x"),
                      base_dir=tmp_path, seed=0)


# --- trace_stats ---------------------------------------------------------------------------------


def test_trace_stats_small_example():
    reqs = [
        Request(0, 0.0, 1024, 5, hash_ids=np.array([1, 2])),
        Request(1, 2.0, 1500, 7, hash_ids=np.array([1, 2, 3])),  # reuses 1024
        Request(2, 4.0, 700, 9, hash_ids=np.array([1, 4])),  # reuses 512
        Request(3, 4.0, 1024, 9, hash_ids=np.array([1, 2])),  # all seen: capped at 1023
    ]
    stats = trace_stats(reqs, block_sizes=(100, 512))
    assert stats["requests"] == 4 and stats["duration_s"] == 4.0 and stats["rate_rps"] == 1.0
    assert stats["prompt_tokens"] == 4248
    assert stats["input_length"]["max"] == 1500 and stats["output_length"]["mean"] == 7.5
    assert stats["ideal_hit_rate"][512] == (1024 + 512 + 512) / 4248
    assert stats["ideal_hit_rate"][100] == (1000 + 500 + 1000) / 4248


def test_trace_stats_token_requests():
    a = np.arange(300, dtype=np.int64)
    reqs = [
        Request(0, 0.0, 300, 1, tokens=a),
        Request(1, 1.0, 300, 1, tokens=a.copy()),  # all seen: capped at 299 -> 2 blocks of 100
        Request(2, 2.0, 250, 1, tokens=np.concatenate([a[:150], a[:100] + 1000])),
    ]
    assert trace_stats(reqs, block_sizes=(100,))["ideal_hit_rate"][100] == (200 + 100) / 850


def test_a_run_keeps_the_memos_of_its_block_size_only(monkeypatch, tmp_path):
    """The loaded request list outlives a variant's run (the next variant reuses it): a run at
    the previous run's block size reuses its memoised keys, a run at another begins without
    them (`RequestList.begin_pass`)."""
    import kvbench.runner as runner
    from kvbench.config import load_workload
    from kvbench.traffic import RequestList

    path = tmp_path / "w.yaml"
    path.write_text(
        "cache: {tokens_per_block: 16, max_tokens: 4096}\n"
        "requests: {source: synthetic, synthetic: {generator: shared_prefix, num_requests: 30,"
        " system_prompt_tokens: 64, prompt_tokens: 32, num_users: 4}}\n"
        "run: {mode: cache, progress: false}\n"
        "variants: [{name: a, set: {}}, {name: a2, set: {cache.max_tokens: 2048}},"
        " {name: b, set: {cache.tokens_per_block: 32}}]\n")
    seen = []
    real = runner.run_cache

    def memos(requests):
        return [{tpb: id(keys) for tpb, keys in r._keys.items()} for r in requests]

    def spy(name, plan, requests, progress, references):
        before = memos(requests)
        out = real(name, plan, requests, progress, references)
        seen.append((requests, before, memos(requests)))
        return out

    monkeypatch.setattr(runner, "run_cache", spy)
    runner.run_workload(load_workload(path))
    (first, none, keys_a), (second, reused, keys_a2), (third, gone, keys_b) = seen
    assert first is second is third and isinstance(first, RequestList)
    assert all(m == {} for m in none) and all(list(m) == [16] for m in keys_a)
    assert reused == keys_a == keys_a2  # a2 began with a's memos (the same lists) and kept them
    assert all(m == {} for m in gone) and all(list(m) == [32] for m in keys_b)  # b: without
