"""Reader for Alibaba ServeGen offline traces (alibaba/ServeGen, data/offline).

One JSON object a line, one line a request of a batch task, in the order it was submitted:
`request_id`, `type` and `input_length`, then either `hash_ids` (prefix ids of 16-token blocks,
ceil) and `img_ids` (the images of a multimodal prompt) - the content-hash traces - or
`output_length` and `duration` (ms) - the stat traces, which say nothing of prefixes: their
prompts share nothing. The traces have no times: requests arrive by `requests.sessions` (each
request a session of its own; `back_to_back` = all at 0 in file order) and generate their
`output_length`, else `requests.output_length` tokens.

Equal hash-id prefixes are reusable KV whatever the images: the release's own example is two
captioning requests with different images that share their first 23 blocks. So `img_ids` are
checked but take no part in the ids' chain.
"""

from __future__ import annotations

from collections.abc import Iterator

from kvbench.traffic.mooncake import MAX_INPUT_LENGTH, MAX_OUTPUT_LENGTH
from kvbench.traffic.request import Request
from kvbench.traffic.sessions import single_request_arrivals
from kvbench.traffic.tracefile import (
    BadField,
    ChainedIds,
    HashIdReader,
    chained_hash_ids,
    check_hash_id,
    check_int,
    fail,
    need,
    need_int,
    need_str,
    show,
)

SERVEGEN_BLOCK_TOKENS = 16


class ServeGenReader(HashIdReader):
    format = "servegen"

    default_block_tokens = SERVEGEN_BLOCK_TOKENS

    def _requests(self) -> Iterator[Request]:
        name = str(self.path)
        table = ChainedIds()
        block = self.block_tokens
        arrivals = single_request_arrivals(self.opts.sessions, self.opts.seed)
        for lineno, obj in self._records:
            try:
                for key in ("request_id", "type", "input_length"):
                    need(obj, key)
                rid = obj["request_id"]
                if type(rid) not in (int, str):
                    raise BadField(f"'request_id' must be an integer or a string, got {show(rid)}")
                need_str(obj, "type")
                input_length = need_int(obj, "input_length", 1, MAX_INPUT_LENGTH - 1)
                output_length = (check_int("output_length", obj["output_length"], 0,
                                           MAX_OUTPUT_LENGTH)
                                 if "output_length" in obj else self.opts.output_length)
                images = obj.get("img_ids", [])
                if type(images) is not list:
                    raise BadField(f"'img_ids' must be a list of integers or strings, got "
                                   f"{show(images)}")
                for h in images:
                    check_hash_id("img_ids", h)
                if "hash_ids" in obj:
                    ids = chained_hash_ids(obj, table, self.cover, input_length, lineno)
                else:
                    self.without_ids += 1
                    ids = table.fresh_blocks(input_length, block)
            except BadField as e:
                raise fail(name, lineno, str(e)) from None
            yield Request(id=0, arrival_s=next(arrivals), input_length=input_length,
                          output_length=output_length, hash_ids=ids, trace_block_tokens=block)
