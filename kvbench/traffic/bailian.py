"""Reader for Alibaba Bailian usage traces (qwen-bailian-usagetraces-anon).

One JSON object a line: `chat_id`, `parent_chat_id` (-1 = the root of a conversation),
`timestamp` (float **seconds**), `input_length`, `output_length`, `type`, `turn` and `hash_ids`:
prefix ids of 16-token blocks, one per block including the partial last one (ceil). Ids are
remapped along their chain (`tracefile.ChainedIds`), so any id type works and none collide.
"""

from __future__ import annotations

from collections.abc import Iterator

from kvbench.traffic.mooncake import MAX_INPUT_LENGTH, MAX_OUTPUT_LENGTH
from kvbench.traffic.request import Request
from kvbench.traffic.tracefile import (
    BadField,
    ChainedIds,
    HashIdReader,
    UnitCheck,
    chained_hash_ids,
    fail,
    need,
    need_int,
    need_number,
    need_str,
)

BAILIAN_BLOCK_TOKENS = 16
_FIELDS = ("chat_id", "parent_chat_id", "timestamp", "input_length", "output_length", "type",
           "turn", "hash_ids")


class BailianReader(HashIdReader):
    format = "bailian"

    default_block_tokens = BAILIAN_BLOCK_TOKENS

    def _requests(self) -> Iterator[Request]:
        name = str(self.path)
        table = ChainedIds()
        units = UnitCheck("timestamp", "s")
        prev_ts = 0.0
        for lineno, obj in self._records:
            try:
                for key in _FIELDS:
                    need(obj, key)
                need_int(obj, "chat_id", 0)
                need_int(obj, "parent_chat_id", -1)
                ts = need_number(obj, "timestamp", "s")
                if ts < prev_ts:
                    raise BadField(f"timestamp {ts} is before the previous request's {prev_ts}")
                input_length = need_int(obj, "input_length", 1, MAX_INPUT_LENGTH - 1)
                output_length = need_int(obj, "output_length", 0, MAX_OUTPUT_LENGTH)
                need_str(obj, "type")
                need_int(obj, "turn", 0)
                ids = chained_hash_ids(obj, table, self.cover, input_length, lineno)
            except BadField as e:
                raise fail(name, lineno, str(e)) from None
            units.check(name, lineno, ts)
            prev_ts = ts
            yield Request(id=0, arrival_s=float(ts), input_length=input_length,
                          output_length=output_length, hash_ids=ids,
                          trace_block_tokens=self.block_tokens)
