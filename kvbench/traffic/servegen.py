"""Reader for Alibaba ServeGen offline traces.

One JSON object a line: `request_id`, `type`, `input_length`, `hash_ids` (prefix ids of 16-token
blocks, ceil) and `img_ids` (the images of a multimodal prompt). The trace has no times and no
output lengths: requests arrive by `requests.sessions` (each request a session of its own;
`back_to_back` = all at 0 in file order) and generate `requests.output_length` tokens.

The trace does not say where images sit inside a prompt, so a prompt's images are the root of its
id chain: prompts with equal text ids but different images share nothing, prompts with the same
images (or none) share their common text prefix.
"""

from __future__ import annotations

from collections.abc import Iterator

from kvbench.traffic.mooncake import MAX_INPUT_LENGTH
from kvbench.traffic.request import Request
from kvbench.traffic.tracefile import (
    BadField,
    ChainedIds,
    HashIdReader,
    chained_hash_ids,
    check_hash_id,
    fail,
    need,
    need_int,
    need_str,
    show,
    single_request_arrivals,
)

SERVEGEN_BLOCK_TOKENS = 16


class ServeGenReader(HashIdReader):
    format = "servegen"
    description = "a ServeGen trace (`request_id`, `img_ids`, no timestamp)"

    default_block_tokens = SERVEGEN_BLOCK_TOKENS

    def _requests(self) -> Iterator[Request]:
        name = str(self.path)
        table = ChainedIds()
        arrivals = single_request_arrivals(self.opts.sessions, self.opts.seed)
        for lineno, obj in self._records:
            try:
                for key in ("request_id", "type", "input_length", "hash_ids"):
                    need(obj, key)
                rid = obj["request_id"]
                if type(rid) not in (int, str):
                    raise BadField(f"'request_id' must be an integer or a string, got {show(rid)}")
                need_str(obj, "type")
                input_length = need_int(obj, "input_length", 1, MAX_INPUT_LENGTH - 1)
                images = obj.get("img_ids", [])
                if type(images) is not list:
                    raise BadField(f"'img_ids' must be a list of integers or strings, got "
                                   f"{show(images)}")
                for h in images:
                    check_hash_id("img_ids", h)
                root = ("images", tuple(images)) if images else None
                ids = chained_hash_ids(obj, table, self.cover, input_length, lineno, root)
            except BadField as e:
                raise fail(name, lineno, str(e)) from None
            yield Request(id=0, arrival_s=next(arrivals), input_length=input_length,
                          output_length=self.opts.output_length, hash_ids=ids,
                          trace_block_tokens=self.block_tokens)
