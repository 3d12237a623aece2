"""Small traces in every supported format, written by the tests (no trace is downloaded or
checked in). The same multi-turn chat traffic (sessions that share a system prompt and grow
turn by turn) is written in each format, hashed at that format's usual block size.

`python tests/trace_samples.py DIR` writes them where `workloads/formats/*.yaml` expect them
(`workloads/formats/samples`).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

SYSTEM_TOKENS = 300
SESSIONS = 6
TURNS = 4


def chat_sessions(seed: int = 0) -> list[list[tuple[float, list[int], int]]]:
    """Per session, its turns: (seconds from the session's start, prompt tokens, output length)."""
    rng = random.Random(seed)
    system = [rng.randrange(32000) for _ in range(SYSTEM_TOKENS)]
    out = []
    for _ in range(SESSIONS):
        history = list(system)
        turns, t = [], 0.0
        for _ in range(TURNS):
            history += [rng.randrange(32000) for _ in range(rng.randrange(40, 400))]
            answer = rng.randrange(20, 200)
            turns.append((t, list(history), answer))
            history += [rng.randrange(32000) for _ in range(answer)]
            t += rng.uniform(2.0, 20.0)
        out.append(turns)
    return out


def timed_requests(seed: int = 0) -> list[tuple[float, list[int], int, int]]:
    """(arrival s, tokens, output length, session) of every turn, sessions 7 s apart."""
    reqs = [(7.0 * s + t, toks, out, s)
            for s, turns in enumerate(chat_sessions(seed)) for t, toks, out in turns]
    return sorted(reqs, key=lambda r: r[0])


def block_ids(tokens: list[int], block: int, table: dict, cover: str = "ceil",
              root=None) -> list[int]:
    """Prefix-chained ids of the token blocks (ceil: the partial last block too)."""
    end = len(tokens) if cover == "ceil" else len(tokens) // block * block
    ids, parent = [], root
    for i in range(0, end, block):
        key = (parent, tuple(tokens[i:i + block]))
        parent = table.setdefault(key, len(table) + 1)
        ids.append(parent)
    return ids


def write_lines(path: Path, objs) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(o) + "\n" for o in objs))
    return path


def write_samples(folder: Path, seed: int = 0) -> dict[str, Path]:
    folder = Path(folder)
    reqs = timed_requests(seed)
    paths = {}
    table: dict = {}
    paths["mooncake"] = write_lines(folder / "mooncake.jsonl", (
        {"timestamp": round(t * 1000), "input_length": len(toks), "output_length": out,
         "hash_ids": block_ids(toks, 512, table)} for t, toks, out, _ in reqs))
    table = {}
    paths["bailian"] = write_lines(folder / "bailian.jsonl", (
        {"chat_id": i, "parent_chat_id": -1, "timestamp": round(t, 3), "input_length": len(toks),
         "output_length": out, "type": "text", "turn": 1, "hash_ids": block_ids(toks, 16, table)}
        for i, (t, toks, out, _) in enumerate(reqs)))
    table = {}
    paths["servegen"] = write_lines(folder / "servegen.jsonl", (
        {"request_id": i, "type": "text", "input_length": len(toks),
         "hash_ids": block_ids(toks, 16, table), "img_ids": []}
        for i, (t, toks, out, _) in enumerate(reqs)))
    paths["token_ids"] = write_lines(folder / "token_ids.jsonl", (
        {"task_id": i, "timestamp": round(t * 1000), "input_ids": toks, "output_tokens": out}
        for i, (t, toks, out, _) in enumerate(reqs)))
    weka = folder / "weka"
    weka.mkdir(parents=True, exist_ok=True)
    table = {}
    for s, turns in enumerate(chat_sessions(seed)):
        doc = {"id": f"conv-{s}", "models": ["main"], "block_size": 64, "hash_id_scope": "global",
               "tool_tokens": 0, "system_tokens": SYSTEM_TOKENS, "requests": [
                   {"t": t, "type": "n", "model": "main", "in": len(toks), "out": out,
                    "hash_ids": block_ids(toks, 64, table, "floor")} for t, toks, out in turns]}
        (weka / f"conv-{s}.json").write_text(json.dumps(doc, indent=1))
    paths["weka"] = weka
    csv = folder / "lengths.csv"
    csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
        f"2023-11-16 18:{int(t) // 60:02d}:{t % 60:09.6f}0,{len(toks)},{out}\n"
        for t, toks, out, _ in reqs))
    paths["lengths_csv"] = csv
    paths["chat"] = write_lines(folder / "chat.jsonl", (
        {"id": f"conv-{s}", "conversations": chat_messages(turns)}
        for s, turns in enumerate(chat_sessions(seed))))
    return paths


def words(tokens: list[int]) -> str:
    """Text whose every token is one word: a space and the id in letters (`approx` reads each
    such word as one token, so the text has exactly these tokens' sharing)."""
    out = []
    for t in tokens:
        letters = ""
        while True:
            t, d = divmod(t, 26)
            letters += chr(97 + d)
            if not t:
                break
        out.append(" " + letters)
    return "".join(out)


def chat_messages(turns) -> list[dict]:
    """A session's turns as ShareGPT messages: the system prompt, then per turn the user's new
    tokens and the answer (as many words as the turn's output length)."""
    system = turns[0][1][:SYSTEM_TOKENS]
    messages = [{"from": "system", "value": words(system)}]
    seen = len(system)
    for i, (_, toks, out) in enumerate(turns):
        messages.append({"from": "human", "value": words(toks[seen:])})
        # The next turn's prompt holds this answer; the last answer is never read again.
        nxt = turns[i + 1][1] if i + 1 < len(turns) else toks + [0] * out
        messages.append({"from": "gpt", "value": words(nxt[len(toks):len(toks) + out])})
        seen = len(toks) + out
    return messages


if __name__ == "__main__":
    for fmt, path in write_samples(Path(sys.argv[1])).items():
        print(f"{fmt}: {path}")
