"""Streaming cache mode for traces: spilled requests, streamed ideal/optimal references equal to
the in-memory ones, memory that does not grow with the trace, the runner's choice of path,
and tiling a trace into a production-size one."""

from __future__ import annotations

import json
import shutil
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import run_cli, run_metrics
from hypothesis import given, settings
from hypothesis import strategies as st
from trace_samples import write_samples

import kvbench.runner as runner
import kvbench.traffic.spill as spill
from kvbench.oracle import reference_hit_rates, streamed_reference_hit_rates
from kvbench.traffic import TraceOptions, open_trace
from kvbench.traffic.request import Request
from kvbench.traffic.spill import NotSpillable, SpilledTrace

ROOT = Path(__file__).resolve().parents[1]


@st.composite
def hash_traces(draw):
    """Prefix-chained hash-id prompts: most extend a prefix of an earlier one."""
    block = draw(st.sampled_from([2, 3, 4, 8]))
    n = draw(st.integers(1, 14))
    paths: list[list[int]] = []
    reqs = []
    next_id = 0
    for i in range(n):
        if paths and draw(st.booleans()):
            base = draw(st.sampled_from(paths))
            keep = draw(st.integers(1, len(base)))
            ids = base[:keep]
        else:
            ids = []
        extra = draw(st.integers(0 if ids else 1, 4))
        ids = ids + list(range(next_id, next_id + extra))
        next_id += extra
        paths.append(ids)
        length = draw(st.integers((len(ids) - 1) * block + 1, len(ids) * block))
        reqs.append(Request(i, float(i), length, 1, hash_ids=np.array(ids, dtype=np.int64),
                            trace_block_tokens=block))
    return reqs


@settings(max_examples=100, deadline=None)
@given(hash_traces(), st.integers(1, 9), st.integers(0, 6), st.booleans())
def test_streamed_references_equal_in_memory(requests, tpb, extra, partial):
    capacity = max(-(-r.input_length // tpb) for r in requests) + extra
    expected = reference_hit_rates(requests, tpb, capacity, partial_reuse=partial)
    for r in requests:
        r.drop_keys()
    trace = SpilledTrace(iter(requests))
    try:
        assert streamed_reference_hit_rates(trace, tpb, capacity, partial_reuse=partial) == expected
        assert streamed_reference_hit_rates(trace, tpb, None, partial_reuse=partial) == (
            reference_hit_rates(requests, tpb, None, partial_reuse=partial))
        assert streamed_reference_hit_rates(trace, tpb, capacity, partial_reuse=partial,
                                            block_reuse=False).ideal_reused_tokens == 0
    finally:
        trace.close()


def test_spill_reads_forwards_and_backwards_across_chunks(monkeypatch):
    monkeypatch.setattr(spill, "_CHUNK_IDS", 5)
    rng = np.random.default_rng(0)
    reqs = [Request(i, i * 0.5, int(n) * 4, 2, hash_ids=np.arange(k, k + n, dtype=np.int64),
                    trace_block_tokens=4)
            for i, (k, n) in enumerate(zip(rng.integers(0, 50, 40), rng.integers(1, 9, 40)))]
    trace = SpilledTrace(iter(reqs))
    try:
        assert len(trace) == 40 and trace.prompt_tokens == sum(r.input_length for r in reqs)
        again = list(trace)
        assert [(r.id, r.arrival_s, r.input_length, r.hash_ids.tolist()) for r in again] == [
            (r.id, r.arrival_s, r.input_length, r.hash_ids.tolist()) for r in reqs]
        back = [ids.tolist() for ids in trace.ids_backward()]
        assert back == [r.hash_ids.tolist() for r in reversed(reqs)]
        big = trace.largest()
        assert trace.input_lengths[big] == max(r.input_length for r in reqs)
    finally:
        trace.close()


def test_streamed_optimum_evicts_a_block_stored_again_before_its_reuse():
    # Request 2 computes block [0] in any case; the optimum lets it go for request 1's blocks
    # and request 3 reuses all four (`test_oracle` has the case on token prompts).
    chains = [[0, 1, 2, 3], [7, 8], [0], [0, 1, 2, 3, 4], [0]]
    requests = [Request(i, float(i), len(ids), 1, hash_ids=np.array(ids, dtype=np.int64),
                        trace_block_tokens=1) for i, ids in enumerate(chains)]
    assert reference_hit_rates(requests, 1, 5, partial_reuse=False).optimal_reused_tokens == 4
    for r in requests:
        r.drop_keys()
    trace = SpilledTrace(iter(requests))
    try:
        assert streamed_reference_hit_rates(trace, 1, 5, partial_reuse=False) \
            .optimal_reused_tokens == 4
    finally:
        trace.close()


def test_spill_refuses_what_it_cannot_stream():
    tokens = [Request(0, 0.0, 3, 1, tokens=np.arange(3))]
    sparse = [Request(0, 0.0, 8, 1, hash_ids=np.array([1 << 38, 5]), trace_block_tokens=4)]
    mixed = [Request(0, 0.0, 4, 1, hash_ids=np.array([0]), trace_block_tokens=4),
             Request(1, 0.0, 8, 1, hash_ids=np.array([0]), trace_block_tokens=8)]
    for reqs in (tokens, sparse, mixed):
        with pytest.raises(NotSpillable):
            SpilledTrace(iter(reqs))


def test_streamed_memory_does_not_grow_with_the_trace():
    """The same conversations replayed 1x and 4x over (same ids): the streamed references'
    peak memory stays put, the in-memory references' grows with the trace."""
    rng = np.random.default_rng(1)
    base = []
    for i in range(200):
        n = int(rng.integers(4, 40))
        ids = np.concatenate([np.arange(3), 100 + np.arange(i * 40, i * 40 + n)])
        base.append((ids, len(ids) * 16))

    def trace(times):
        return [Request(k * len(base) + i, 0.0, length, 1, hash_ids=ids, trace_block_tokens=16)
                for k in range(times) for i, (ids, length) in enumerate(base)]

    peaks = {}
    for times in (1, 4):
        spilled = SpilledTrace(iter(trace(times)))
        tracemalloc.start()
        streamed_reference_hit_rates(spilled, 8, 500, partial_reuse=False)
        peaks[times] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        spilled.close()
        reqs = trace(times)
        tracemalloc.start()
        reference_hit_rates(reqs, 8, 500, partial_reuse=False)
        peaks[("memory", times)] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peaks[4] < 1.25 * peaks[1]
    assert peaks[("memory", 4)] > 3 * peaks[("memory", 1)]


# --- the runner ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def samples(tmp_path_factory):
    folder = tmp_path_factory.mktemp("stream")
    write_samples(folder / "samples")
    for fmt in ("mooncake", "bailian", "weka", "token_ids"):
        shutil.copy(ROOT / "workloads" / "formats" / f"{fmt}.yaml", folder / f"{fmt}.yaml")
    return folder


@pytest.mark.parametrize("fmt", ["mooncake", "bailian", "weka", "token_ids"])
def test_runner_streams_traces_with_the_same_results(samples, capsys, monkeypatch, fmt):
    loads = []
    real = runner._load
    monkeypatch.setattr(runner, "_load", lambda wl, stream=False: loads.append(
        type(r := real(wl, stream)).__name__) or r)
    path = samples / f"{fmt}.yaml"
    streamed = run_metrics(path, capsys, "cache.max_tokens=4096")
    monkeypatch.setattr(runner, "_streamable", lambda wl: False)
    in_memory = run_metrics(path, capsys, "cache.max_tokens=4096")
    assert streamed == in_memory
    # token_ids prompts are explicit tokens: no spill, the trace is read again into memory.
    assert loads == (["RequestList", "RequestList"] if fmt == "token_ids"
                     else ["SpilledTrace", "RequestList"])


def test_runner_falls_back_for_remapped_ids(tmp_path, capsys, samples):
    text = (samples / "samples" / "mooncake.jsonl").read_text()
    lines = [json.loads(x) for x in text.splitlines()]
    for line in lines:
        line["hash_ids"] = [f"h{h}" for h in line["hash_ids"]]
    (tmp_path / "samples").mkdir()
    (tmp_path / "samples" / "mooncake.jsonl").write_text(
        "".join(json.dumps(x) + "\n" for x in lines))
    shutil.copy(samples / "mooncake.yaml", tmp_path / "mooncake.yaml")
    strings = run_metrics(tmp_path / "mooncake.yaml", capsys)
    ints = run_metrics(samples / "mooncake.yaml", capsys)
    assert strings == ints


def test_tile_makes_fresh_ids_and_shifted_times(samples, tmp_path, capsys):
    source = samples / "samples" / "bailian.jsonl"
    out = tmp_path / "tiled.jsonl"
    code, _, err = run_cli(["trace", "convert", source, out, "--tile", "3"], capsys)
    assert code == 0, err
    one = list(open_trace(source, "bailian"))
    three = list(open_trace(out, "mooncake", TraceOptions(block_tokens=16)))
    assert len(three) == 3 * len(one)
    span = one[-1].arrival_s - one[0].arrival_s
    shift = span + span / (len(one) - 1)
    for k in range(3):
        tile = three[k * len(one):(k + 1) * len(one)]
        assert [r.arrival_s for r in tile] == pytest.approx(
            [r.arrival_s + k * shift for r in one])
        assert [r.input_length for r in tile] == [r.input_length for r in one]
    ids = [set(np.concatenate([r.hash_ids for r in three[k * len(one):(k + 1) * len(one)]])
               .tolist()) for k in range(3)]
    assert not ids[0] & ids[1] and not ids[1] & ids[2]
    a = reference_hit_rates(one, 16, None, partial_reuse=True)
    b = reference_hit_rates(three, 16, None, partial_reuse=True)
    assert b.ideal_reused_tokens == 3 * a.ideal_reused_tokens
