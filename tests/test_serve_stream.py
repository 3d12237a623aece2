"""What serve mode adds to the request model: the stream of prompt and generated tokens."""

from types import SimpleNamespace

import numpy as np
import pytest

from kvbench.traffic import generate
from kvbench.traffic.request import Request


def trace(i, ids, length, out):
    return Request(i, 0.0, length, out, hash_ids=np.array(ids, dtype=np.int64))


@pytest.mark.parametrize("tpb", [3, 16, 64])
def test_stream_extends_the_prompt(tpb):
    answer = np.arange(500, 540)
    r = Request(0, 0.0, 50, 40, tokens=np.arange(50), output_tokens=answer)
    assert np.array_equal(r.stream_tokens(), np.concatenate([np.arange(50), answer]))
    assert np.array_equal(r.stream_tokens(45, 55), [45, 46, 47, 48, 49, 500, 501, 502, 503, 504])
    keys = r.stream_keys(tpb)
    assert len(keys) == 90 // tpb and keys[:50 // tpb] == r.block_keys(tpb)
    assert len(r.block_keys(tpb)) == 50 // tpb  # the prompt's keys are unchanged
    firsts = r.stream_first_tokens(tpb)
    assert firsts[:len(r.first_tokens(tpb))] == r.first_tokens(tpb)
    assert firsts == r.stream_tokens()[::tpb].tolist()


def test_known_answers_key_like_the_next_turn():
    cfg = SimpleNamespace(
        generator="multi_turn", num_requests=6, system_prompt_tokens=40, prompt_tokens=20,
        prompt_tokens_spread=0.5, output_tokens=30, num_users=1, turns=6, arrival="burst",
        rate=1.0, vocab_size=1000)
    turns = generate(cfg, 0)
    for prev, nxt in zip(turns, turns[1:]):
        for tpb in (4, 32):
            keys = prev.stream_keys(tpb)
            assert nxt.block_keys(tpb)[:len(keys)] == keys


def test_derived_generated_tokens_never_collide():
    a, b = trace(0, [1, 2], 600, 300), trace(1, [1, 2], 600, 300)
    ga, gb = a.stream_tokens(600), b.stream_tokens(600)
    assert len(ga) == 300 and np.all(ga < 0) and np.all(gb < 0)
    assert not set(ga.tolist()) & set(gb.tolist())
    assert np.array_equal(a.stream_tokens(0, 600), a.prompt_tokens())
    ka, kb = a.stream_keys(64), b.stream_keys(64)
    n = 600 // 64
    assert ka[:n] == kb[:n] == a.block_keys(64)
    assert not set(ka[n:]) & set(kb[n:])
    s = Request(2, 0.0, 5, 7, tokens=np.arange(5))
    assert np.all(s.stream_tokens(5) < 0)


def test_view_is_a_prompt_prefix_of_the_stream():
    r = Request(0, 0.0, 8, 6, tokens=np.arange(8), output_tokens=np.arange(100, 106))
    v = r.view(11)
    assert (v.id, v.input_length, v.root_key, v.priority) == (0, 11, r.root_key, r.priority)
    assert v.block_keys(4) == r.stream_keys(4)
    assert np.array_equal(v.prompt_tokens(), [0, 1, 2, 3, 4, 5, 6, 7, 100, 101, 102])
    assert np.array_equal(v.prompt_tokens(12, 99), [104, 105])
    assert v.first_tokens_array(4).tolist() == [0, 4, 100, 104]
    with pytest.raises(ValueError):
        r.view(15)
    with pytest.raises(ValueError):
        Request(0, 0.0, 2, 3, tokens=np.arange(2), output_tokens=np.arange(2))


def test_drop_keys_forgets_stream_keys():
    r = trace(0, [1, 2], 600, 100)
    r.stream_keys(64)
    r.stream_first_tokens(64)
    r.drop_keys()
    assert not r._stream_keys and not r._stream_firsts
