"""Hostile-input fuzz (issue 14): mutated workload YAML, `--set` values, traces of every supported format and result
JSON go through the CLI in-process; every case must end in exit 0 (or 3 for a compare that
found a regression) or in exit 2 with one `kvbench: error:` line, never a traceback or exit 1,
in bounded time and memory.

The default suite runs FUZZ_EXAMPLES cases in all; `python -m pytest -m fuzz tests/test_fuzz.py`
runs the long campaign (KVBENCH_FUZZ_EXAMPLES, 10,000 by default). Hypothesis is derandomized,
so a run is reproducible and a failure is shrunk to its smallest case.

Sizes are drawn from small numbers and edge values (0, -1, 2**31, 2**63, 10**20, ...) rather
than the whole integer range: a legitimately large workload (a million requests) is slow by
design, not hostile input, while absurd sizes must be refused before anything is allocated.
"""

import json
import math
import os
import resource
import shutil
import time

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cli_helpers import run_cli
from kvbench.config import Workload
from kvbench.config_errors import as_model

FUZZ_EXAMPLES = int(os.environ.get("KVBENCH_FUZZ_DEFAULT", "500"))
"""Cases in the default suite, over all targets."""
LONG_EXAMPLES = int(os.environ.get("KVBENCH_FUZZ_EXAMPLES", "10000"))
CASE_SECONDS = 20.0
"""Wall time one case may take on a loaded, shared 2-core machine (most take milliseconds;
a report renders PNGs, about a second)."""
RSS_GROWTH_BYTES = 1 << 30
"""How far the test process's peak RSS may grow over a whole campaign."""

# Share of each campaign per target (yaml, set, trace, result): they sum to 1.
SHARES = {"yaml": 0.4, "set": 0.2, "trace": 0.2, "result": 0.2}

TINY = """\
name: fz
model: {num_layers: 2, num_kv_heads: 1, num_q_heads: 1, head_dim: 8}
cache: {tokens_per_block: 16, max_tokens: 1024}
requests:
  synthetic: {generator: shared_prefix, num_requests: 12, system_prompt_tokens: 32,
              prompt_tokens: 16, num_users: 3, output_tokens: 4}
run: {seed: 1, progress: false}
variants:
  - {name: a}
  - {name: b, set: {cache.tokens_per_block: 32, run.mode: serve}}
"""

TRACE_RECORDS = 4
"""Records of each format's sample (`trace_samples.py`) a trace case starts from."""


def _dotted_keys(model=Workload, prefix: str = "") -> list[str]:
    keys = []
    for name, info in model.model_fields.items():
        sub = as_model(info.annotation)
        keys.append(prefix + name)
        if sub is not None:
            keys += _dotted_keys(sub, f"{prefix}{name}.")
    return keys


KEYS = _dotted_keys()

EDGE_INTS = [0, 1, 2, 3, 7, 8, 16, 31, 33, 64, 4096, -1, -(2**31), 2**31 - 1, 2**31, 2**32,
             2**53 + 1, 2**63 - 1, 2**63, 2**64, 10**20, 10**400]
words = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=12)
scalars = st.one_of(
    st.sampled_from(EDGE_INTS), st.integers(-4, 300),
    st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.none(), words,
    st.sampled_from(["off", "on", "yes", "none", "torch", "serve", "trace", "mooncake",
                     "batch", "1e999", "-.inf", "/dev/zero", ".", "", "synthetic",
                     "shared_prefix", "multi_turn", "hit_rate >= 0.5", "drop", "window"]),
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(KEYS) | words, inner, max_size=4),
    max_leaves=12,
)


def _rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def check(args, capsys, allowed=(0, 2)) -> None:
    t0 = time.perf_counter()
    code, out, err = run_cli(args, capsys)
    elapsed = time.perf_counter() - t0
    assert "Traceback" not in err + out, err
    assert code in allowed, f"exit {code}: {err}"
    if code == 2:
        lines = err.strip().splitlines()
        assert [line for line in lines if not line.startswith("kvbench: warning:")] == [
            lines[-1]], err
        assert lines[-1].startswith("kvbench: error: ") and len(lines[-1]) < 2000, err
    assert elapsed < CASE_SECONDS, f"{elapsed:.1f} s: {args}"


# --- targets -------------------------------------------------------------------------------------


def _set_path(data, path: list, value, delete: bool) -> None:
    node = data
    for part in path[:-1]:
        child = node.get(part) if isinstance(node, dict) else None
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    if delete:
        node.pop(path[-1], None)
    else:
        node[path[-1]] = value


@st.composite
def mutated_yaml(draw) -> str:
    data = yaml.safe_load(TINY)
    for _ in range(draw(st.integers(1, 4))):
        key = draw(st.sampled_from(KEYS) | words.filter(bool))
        _set_path(data, key.split("."), draw(values), draw(st.booleans()) and draw(st.booleans()))
    text = yaml.safe_dump(data, allow_unicode=True)
    edit = draw(st.sampled_from(["none", "none", "insert", "truncate", "replace", "anchor"]))
    if edit != "none" and text:
        at = draw(st.integers(0, len(text)))
        if edit == "insert":
            text = text[:at] + draw(st.sampled_from(
                [": ", "- ", "*x", "&x ", "<<: ", "{", "[", "\t", "\n  ", "!!binary ", "%"]))
            text += text[at:]
        elif edit == "truncate":
            text = text[:at]
        elif edit == "replace":
            text = text[:at] + draw(words) + text[at + 1:]
        else:
            text = "x: &x [" + ", ".join(["1"] * draw(st.integers(1, 9))) + "]\n" + text
    return text


@st.composite
def set_items(draw) -> list[str]:
    items = []
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.sampled_from(KEYS) | words)
        if draw(st.booleans()):
            text = yaml.safe_dump(draw(values), default_flow_style=True).strip()
            text = text.removesuffix("\n...").removesuffix("...").strip()
        else:
            text = draw(words)
        items.append(f"{key}={text}" if draw(st.integers(0, 9)) else key)
    return items


def _mutated_record(draw, record):
    """A JSON record with one field replaced, dropped or added (or left alone)."""
    record = dict(record)
    choice = draw(st.sampled_from(["keep", "keep", "field", "drop", "extra"]))
    if choice == "field":
        record[draw(st.sampled_from(list(record)))] = draw(values)
    elif choice == "drop":
        record.pop(draw(st.sampled_from(list(record))))
    elif choice == "extra":
        record[draw(words)] = draw(values)
    return record


@st.composite
def trace_case(draw, samples: dict) -> tuple[str, dict[str, bytes]]:
    """(format, {file name: bytes}) of a mutated trace of any supported format: JSONL records
    with fields replaced or lines swapped for raw bytes, CSV rows edited, weka documents with
    a mutated request."""
    fmt = draw(st.sampled_from(sorted(samples)))
    ending = draw(st.sampled_from([b"\n", b"", b"\n\n", b"\r\n"]))
    if fmt == "weka":
        doc = json.loads(samples[fmt])
        requests = doc["requests"][:TRACE_RECORDS]
        doc = _mutated_record(draw, doc)
        if isinstance(doc.get("requests"), list):
            doc["requests"] = [_mutated_record(draw, r) if isinstance(r, dict) else r
                               for r in requests]
        return fmt, {"conv-0.json": json.dumps(doc).encode()}
    lines = samples[fmt].splitlines()
    if fmt == "lengths_csv":
        rows = lines[:TRACE_RECORDS + 1]
        i = draw(st.integers(0, len(rows) - 1))
        cells = rows[i].split(b",")
        j = draw(st.integers(0, len(cells) - 1))
        cells[j] = draw(st.sampled_from([b"", b"-1", b"1e999", b"nan", b"x", b"2**63",
                                         b"9" * 30, b"2023-13-01 00:00:00"]))
        rows[i] = b",".join(cells)
        return fmt, {"t.csv": b"\n".join(rows) + ending}
    out = []
    for raw in lines[:TRACE_RECORDS]:
        if draw(st.integers(0, 5)) == 0:
            out.append(draw(st.binary(max_size=40)))
        else:
            out.append(json.dumps(_mutated_record(draw, json.loads(raw))).encode())
    return fmt, {"t.jsonl": b"\n".join(out) + ending}


def _paths(node, prefix=()) -> list[tuple]:
    found = [prefix]
    if isinstance(node, dict):
        for k, v in node.items():
            found += _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node[:3]):
            found += _paths(v, prefix + (i,))
    return found


@st.composite
def mutated_result(draw, base: dict) -> str:
    data = json.loads(json.dumps(base))
    paths = [p for p in _paths(data) if p]
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(paths))
        node = data
        try:
            for part in path[:-1]:
                node = node[part]
            if draw(st.integers(0, 4)) == 0 and isinstance(node, dict):
                node.pop(path[-1], None)
            else:
                node[path[-1]] = draw(values)
        except (KeyError, IndexError, TypeError):
            continue
    text = json.dumps(data)
    if draw(st.integers(0, 9)) == 0:
        text = text[: draw(st.integers(0, len(text)))]
    return text


# --- the campaign --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    from kvbench.config import load_workload
    from kvbench.results import build_result
    from kvbench.runner import run_workload

    from trace_samples import write_samples

    import matplotlib.figure  # noqa: F401 - imported once here, not timed in the first report

    folder = tmp_path_factory.mktemp("fuzz")
    samples = {}
    for fmt, path in write_samples(folder / "samples").items():
        samples[fmt] = (path / "conv-0.json" if path.is_dir() else path).read_bytes()
    tiny = folder / "tiny.yaml"
    tiny.write_text(TINY)
    base = build_result([run_workload(load_workload(tiny))])
    base_path = folder / "base.json"
    base_path.write_text(json.dumps(base))
    return folder, tiny, base_path, base, samples


def campaign(examples: int):
    """A test function that fuzzes every target with `examples` cases in all."""

    def run(fixtures, capsys):
        folder, tiny, base_path, base, samples = fixtures
        start_rss = _rss()
        counter = {"report": 0}

        def yaml_case(text):
            path = folder / "case.yaml"
            path.write_text(text)
            check(["validate", path], capsys)

        def set_case(items):
            check(["validate", tiny, *[a for i in items for a in ("--set", i)]], capsys)

        def one_trace(case):
            fmt, files = case
            trace = folder / "trace"
            shutil.rmtree(trace, ignore_errors=True)
            trace.mkdir()
            for name, data in files.items():
                (trace / name).write_bytes(data)
            path = trace if fmt == "weka" else trace / next(iter(files))
            check(["trace", "stats", path, "--format", fmt], capsys)
            workload = folder / "trace.yaml"
            workload.write_text("model: {num_layers: 2, num_kv_heads: 1, num_q_heads: 1,"
                                f" head_dim: 8}}\nrequests: {{source: trace, format: auto,"
                                f" path: {path}}}\nrun: {{mode: serve}}\n")
            check(["validate", workload], capsys)

        def result_case(text):
            path = folder / "case.json"
            path.write_text(text)
            check(["compare", base_path, path, "-q"], capsys, allowed=(0, 2, 3))
            counter["report"] += 1
            if counter["report"] % 20 == 0:  # plots are slow: one case in 20 renders
                check(["report", path, "--out", folder / "report", "-q"], capsys)

        targets = [(yaml_case, mutated_yaml()), (set_case, set_items()),
                   (one_trace, trace_case(samples)), (result_case, mutated_result(base))]
        for (fn, strategy), share in zip(targets, SHARES.values()):
            n = max(1, math.floor(examples * share))
            settings(max_examples=n, deadline=None, database=None,
                     suppress_health_check=list(HealthCheck))(given(strategy)(fn))()
        assert _rss() - start_rss < RSS_GROWTH_BYTES

    return run


test_fuzz_cli = campaign(FUZZ_EXAMPLES)
test_fuzz_cli_long = pytest.mark.fuzz(campaign(LONG_EXAMPLES))
