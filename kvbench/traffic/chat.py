"""Reader for text chat traces: OpenAI-style request logs, ShareGPT and LMSYS conversations.

A file is JSON Lines (a record a line) or one JSON array of records (ShareGPT's releases),
read element by element. A record holds its messages under `messages` (`role`, `content`:
OpenAI chat requests, also inside an OpenAI Batch API line's `body`), `conversations` (`from`,
`value`: ShareGPT), `conversation` (`role`, `content`: LMSYS-Chat-1M) or `input` (messages, or
a string: one user message; `instructions` is the system prompt: the OpenAI Responses API), or
a `prompt` string (completions: its text as it is, no template). Content is a string, null, or
a list of parts whose `text` parts count (other parts, images or audio, are skipped and
counted: their tokens are unknown); an assistant message's `tool_calls` count as their JSON
text.

- Messages that end with an assistant's are a **conversation**: one request per assistant
  message after the first message, whose prompt is every message before it and whose output
  is that message (its tokens are known, so in serve mode the next turn's prompt reuses the
  blocks decoded for it).
- Otherwise the record is **one request** (a logged API call, history included) whose prompt
  is all its messages; its output length is `max_completion_tokens`, `max_tokens` or
  `max_output_tokens` when the record sets one, else `requests.output_length`.

A prompt is its messages, each a role header (`<|role|>` and a newline) then its content, then
the assistant's header: a fixed template, not the model's chat template (which adds or drops a
few tokens per message). Text becomes token ids by `requests.tokenizer` (`tokenize.py`). Every
record is a session: it starts at its `timestamp` (ms, on every record or none) or, without
times, by `requests.sessions`; a conversation's turns follow `requests.sessions.turn_interval_s`
apart. The whole file is read before the first request is returned (sessions interleave).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from kvbench.traffic.mooncake import MAX_INPUT_LENGTH, MAX_OUTPUT_LENGTH
from kvbench.traffic.request import Request
from kvbench.traffic.sessions import session_starts
from kvbench.traffic.tokenize import open_tokenizer
from kvbench.traffic.tracefile import (
    _LONG_INTEGER,
    BadField,
    Timestamps,
    TraceOptions,
    TraceReader,
    check_int,
    fail,
    json_type,
    jsonl_records,
    open_binary,
    show,
    warn,
)

MESSAGE_KEYS = ("messages", "conversations", "conversation", "input")
ASSISTANT_ROLES = frozenset(("assistant", "gpt", "chatgpt", "bard", "bing", "model"))
"""Speakers whose messages are the model's output (OpenAI, ShareGPT and LMSYS names)."""
_ROLES = {"human": "user", **{r: "assistant" for r in ASSISTANT_ROLES}}
"""Speaker name -> the role its header shows."""
_OUTPUT_KEYS = ("max_completion_tokens", "max_tokens", "max_output_tokens")


class ChatReader(TraceReader):
    format = "chat"

    def __init__(self, path: Path, opts: TraceOptions) -> None:
        super().__init__(path, opts)
        self.block_tokens = 1
        self.tokenizer = open_tokenizer(opts.tokenizer)
        self.skipped_parts = 0
        """Content parts that are not text (images, audio): not counted."""
        head = b""
        with open_binary(self.path) as f:
            while not head and (chunk := f.read(1 << 12)):  # blank lines may fill a read
                head = chunk.lstrip(b"\xef\xbb\xbf \t\r\n")
        self._array = head.startswith(b"[")
        self._records = None if self._array else jsonl_records(self.path)

    def _requests(self) -> Iterator[Request]:
        name = str(self.path)
        stamps = Timestamps("record", ordered=False)
        gap = self.opts.sessions.turn_interval_s
        sessions = []  # per record: (start ms or None, its requests)
        records = array_records(self.path) if self._array else self._records
        for lineno, obj in records:
            try:
                if not isinstance(obj, dict):
                    raise BadField(f"expected a JSON object, got {json_type(obj)}")
                ts = stamps.read(obj)
                requests = [r for r in self._record(obj) if r.input_length]
            except BadField as e:
                raise fail(name, lineno, str(e)) from None
            if ts is not None:
                stamps.accept(name, lineno, ts)
            if not requests:  # an empty prompt, a lone assistant message: nothing to prefill
                self.without_prompt += 1
                continue
            sessions.append((ts, requests))
        if self.skipped_parts:
            warn(f"{name}: {self.skipped_parts} message parts that are not text (images, "
                 "audio) were skipped: their tokens are not counted")
        if stamps.timed:
            starts = [ts / 1000 for ts, _ in sessions]
        else:
            starts = session_starts([gap * (len(reqs) - 1) for _, reqs in sessions],
                                    self.opts.sessions, self.opts.seed)
        placed = [(start + k * gap, order, r) for order, (start, (_, reqs)) in
                  enumerate(zip(starts, sessions)) for k, r in enumerate(reqs)]
        placed.sort(key=lambda x: (x[0], x[1]))
        for arrival, _, r in placed:
            r.arrival_s = arrival
            yield r

    def _record(self, obj: dict) -> list[Request]:
        """The requests of one record (module docstring)."""
        body = request_body(obj)
        key = next((k for k in MESSAGE_KEYS if k in body), None)
        if key is None:  # a completions prompt: text as it is, no template
            if "prompt" not in body:
                raise BadField("expected 'messages', 'conversations', 'conversation', 'input' "
                               "or 'prompt' (a chat trace)")
            prompt = body["prompt"]
            if type(prompt) is not str:
                raise BadField(f"'prompt' must be a string, got {show(prompt)}")
            tokens = self.tokenizer.encode([prompt])[0]
            return [_request(tokens, self._output_length(body), None)]
        messages = body[key]
        if key == "input" and type(messages) is str:  # the Responses API: one user message
            messages = [{"role": "user", "content": messages}]
        if type(messages) is not list:
            raise BadField(f"'{key}' must be a list of messages, got {show(messages)}")
        if not messages:  # ShareGPT's releases hold some: nothing to replay, not a bad file
            return []
        roles, texts = zip(*(self._message(key, m) for m in messages))
        instructions = body.get("instructions")  # the Responses API's system prompt
        if instructions is not None:
            if type(instructions) is not str:
                raise BadField(f"'instructions' must be a string, got {show(instructions)}")
            roles, texts = ("system", *roles), (instructions, *texts)
        parts = []
        for role, text in zip(roles, texts):
            parts += [f"<|{_ROLES.get(role, role)}|>\n", text]
        encoded = self.tokenizer.encode([*parts, "<|assistant|>\n"])
        ends = np.cumsum([len(t) for t in encoded])
        full = np.concatenate(encoded)
        if roles[-1] not in ASSISTANT_ROLES:  # one logged call: the model answers next
            return [_request(full, self._output_length(body), None)]
        # A conversation: message i's header ends at ends[2i], its content at ends[2i + 1].
        return [_request(full[:ends[2 * i]], int(ends[2 * i + 1] - ends[2 * i]),
                         full[ends[2 * i]:ends[2 * i + 1]])
                for i in range(1, len(roles)) if roles[i] in ASSISTANT_ROLES]

    def _message(self, key: str, m) -> tuple[str, str]:
        if not isinstance(m, dict):
            raise BadField(f"'{key}' must hold message objects, got {show(m)}")
        role_key, text_key = ("from", "value") if "from" in m else ("role", "content")
        role = m.get(role_key)
        if type(role) is not str or not role:
            raise BadField(f"a message of '{key}' needs a '{role_key}' string, got "
                           f"{show(role)}")
        text = self._content(m.get(text_key), text_key)
        calls = m.get("tool_calls")
        if calls:
            text += json.dumps(calls, ensure_ascii=False)
        return role, text

    def _content(self, content, key: str) -> str:
        if content is None or type(content) is str:
            return content or ""
        if type(content) is not list:
            raise BadField(f"'{key}' must be a string, null or a list of parts, got "
                           f"{show(content)}")
        texts = []
        for part in content:
            if type(part) is str:
                texts.append(part)
            elif isinstance(part, dict) and type(part.get("text")) is str:
                texts.append(part["text"])
            elif isinstance(part, dict):
                self.skipped_parts += 1
            else:
                raise BadField(f"'{key}' parts must be objects or strings, got {show(part)}")
        return "".join(texts)

    def _output_length(self, body: dict) -> int:
        key = next((k for k in _OUTPUT_KEYS if body.get(k) is not None), None)
        if key is None:
            return self.opts.output_length
        return check_int(key, body[key], 0, MAX_OUTPUT_LENGTH)


def request_body(record: dict) -> dict:
    """What a record asks: an OpenAI Batch API line's `body`, else the record itself."""
    return record["body"] if isinstance(record.get("body"), dict) else record


def _request(tokens: np.ndarray, output_length: int, output: np.ndarray | None) -> Request:
    if len(tokens) >= MAX_INPUT_LENGTH:
        raise BadField(f"a prompt of {len(tokens)} tokens; at most {MAX_INPUT_LENGTH - 1}")
    if output_length > MAX_OUTPUT_LENGTH:
        raise BadField(f"an answer of {output_length} tokens; at most {MAX_OUTPUT_LENGTH}")
    return Request(id=0, arrival_s=0.0, input_length=len(tokens), output_length=output_length,
                   tokens=tokens, output_tokens=output)


def array_records(path: Path) -> Iterator[tuple[int, object]]:
    """(line, value) of each element of a file holding one JSON array, decoded one element at
    a time (json's C scanner; a ShareGPT release is hundreds of MB)."""
    name = str(path)
    with open_binary(path) as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        raise fail(name, raw.count(b"\n", 0, e.start) + 1, "not UTF-8 text") from None
    del raw
    decoder = json.JSONDecoder()
    space = json.decoder.WHITESPACE.match
    i = space(text, space(text, 0).end() + 1).end()  # past '['
    line, counted = 1, 0
    if text.startswith("]", i):
        _end_of_array(text, i + 1, name)
        return
    while True:
        line += text.count("\n", counted, i)
        counted = i
        try:
            value, end = decoder.raw_decode(text, i)
        except json.JSONDecodeError as e:
            raise fail(name, e.lineno, f"invalid JSON at column {e.colno}: {e.msg}") from None
        except RecursionError:
            raise fail(name, line, "JSON nested too deeply for a trace record") from None
        except ValueError:  # an integer past Python's digit limit for str -> int
            raise fail(name, line, f"invalid JSON: {_LONG_INTEGER}") from None
        yield line, value
        i = space(text, end).end()
        if text.startswith(",", i):
            i = space(text, i + 1).end()
        elif text.startswith("]", i):
            _end_of_array(text, i + 1, name)
            return
        else:
            line += text.count("\n", counted, i)
            counted = i
            raise fail(name, line, "expected ',' or ']' after an array element")


def _end_of_array(text: str, i: int, name: str) -> None:
    rest = json.decoder.WHITESPACE.match(text, i).end()
    if rest != len(text):
        raise fail(name, text.count("\n", 0, rest) + 1, "extra data after the JSON array")
