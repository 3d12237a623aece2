import hashlib
from pathlib import Path

import pytest

from kvbench.config import Workload, load_workload, resolve_path, workload_json_schema
from kvbench.config_keys import apply_sets, parse_set
from kvbench.config_tune import Constraint
from kvbench.errors import InputError


CACHE_KEYS = (
    "tokens_per_block, max_tokens, host_offload_ratio, enable_block_reuse, enable_partial_reuse,"
    " copy_on_partial_reuse, add_sequence, swa_scratch_reuse, secondary_offload_min_priority,"
    " release_out_of_window, window_memory_split, cross_kv_cache_fraction, strict_phase2,"
    " eviction_policy, policy, admission"
)
TOP_KEYS = "name, model, hardware, cache, scheduler, requests, speculative, run, variants, tune"


def write(tmp_path: Path, text: str, name: str = "w.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def error_of(path: Path, sets=()) -> str:
    with pytest.raises(InputError) as info:
        load_workload(path, sets)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_defaults_load(tmp_path):
    path = write(tmp_path, "model:\n  num_layers: 4\n", "my-bench.yaml")
    workload = load_workload(path)
    assert workload.name == "my-bench"
    assert workload.model.num_layers == 4
    assert workload.model.num_q_heads == 32
    assert workload.model.kv_bytes_per_token_per_layer == 2 * 8 * 128 * 2
    assert workload.cache.tokens_per_block == 32
    assert workload.cache.release_out_of_window == "keep_cached"
    assert workload.requests.synthetic.generator == "multi_turn"
    assert workload.run.backend == "none"
    assert workload.tune is None
    assert workload.source_path == path
    assert workload.source_text_sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert workload.variant_workloads() == [("default", workload)]
    resolved = workload.resolved_dict()
    assert "variants" not in resolved and "tune" not in resolved
    assert resolved["cache"]["max_tokens"] == 65536


@pytest.mark.parametrize("text", ["", "{}\n", "# only a comment\n"])
def test_empty_workload_is_an_error(tmp_path, text):
    path = write(tmp_path, text)
    assert error_of(path) == (f"{path}:1:1: empty workload: expected a mapping of workload keys"
                              " (model, cache, requests, run, ...)")


def test_a_name_alone_is_all_defaults(tmp_path):
    workload = load_workload(write(tmp_path, "name: w\n"))
    assert workload.model == Workload().model


@pytest.mark.parametrize(
    ("dtype", "nbytes"), [("fp8", 1), ("float16", 2), ("bfloat16", 2), ("float32", 4)]
)
def test_kv_bytes_per_token_per_layer(dtype, nbytes):
    data = {"model": {"num_kv_heads": 2, "head_dim": 64, "dtype": dtype}}
    model = Workload.model_validate(data).model
    assert model.kv_bytes_per_token_per_layer == 2 * 2 * 64 * nbytes


@pytest.mark.parametrize(
    ("window", "expected"),
    [
        (None, [None] * 5),
        (4096, [4096] * 5),
        ([1024, None], [1024, None, 1024, None, 1024]),
        ([1, 2, 3, 4, 5], [1, 2, 3, 4, 5]),
    ],
)
def test_attention_window_repeats_over_layers(window, expected):
    model = Workload.model_validate({"model": {"num_layers": 5, "attention_window": window}}).model
    assert model.layer_windows == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "name: t\nmodel:\n  num_layers: -3\n",
            "{f}:3:15: model.num_layers: expected a value > 0 (got -3)",
        ),
        (
            "cache:\n  tokens_per_blok: 16\n",
            "{f}:2:3: cache.tokens_per_blok: unknown key; expected one of: {cache_keys}",
        ),
        (
            "modle:\n  num_layers: 2\n",
            "{f}:1:1: modle: unknown key; expected one of: " + TOP_KEYS,
        ),
        (
            "scheduler:\n  max_num_tokens: lots\n",
            "{f}:2:19: scheduler.max_num_tokens: expected an integer (got 'lots')",
        ),
        (
            "scheduler:\n  max_num_tokens: 8192.5\n",
            "{f}:2:19: scheduler.max_num_tokens: expected an integer (got 8192.5)",
        ),
        (
            "cache:\n  enable_block_reuse: 1\n",
            "{f}:2:23: cache.enable_block_reuse: expected true or false (got 1)",
        ),
        (
            "cache: {host_offload_ratio: -0.5}\n",
            "{f}:1:29: cache.host_offload_ratio: expected a value >= 0 (got -0.5)",
        ),
        (
            "scheduler:\n  batch_wait_max_tokens_ratio: 1.5\n",
            "{f}:2:32: scheduler.batch_wait_max_tokens_ratio: expected a value <= 1 (got 1.5)",
        ),
        (
            "model:\n  dtype: fp16\n",
            "{f}:2:10: model.dtype: expected one of 'float16', 'bfloat16', 'float32' or 'fp8' (got 'fp16')",
        ),
        (
            "requests:\n  source: trace\n",
            "{f}:2:3: requests.path: required when requests.source is 'trace'",
        ),
        (
            "requests:\n  path: t.jsonl\n",
            "{f}:2:9: requests.path: only used when requests.source is 'trace' (got 't.jsonl')",
        ),
        (
            "model:\n  num_kv_heads: 5\n",
            "{f}:2:3: model.num_q_heads: expected a multiple of model.num_kv_heads=5 (got 32)",
        ),
        (
            "model:\n  num_kv_heads: 8\n  num_q_heads: 12\n",
            "{f}:3:16: model.num_q_heads: expected a multiple of model.num_kv_heads=8 (got 12)",
        ),
        (
            "model:\n  attention_window: [4096, 0]\n",
            "{f}:2:21: model.attention_window: expected a positive integer up to 2147483647, null,"
            " or a non-empty list of them (got [4096, 0])",
        ),
        (
            "cache:\n  tokens_per_block: 64\n  max_tokens: 32\n",
            "{f}:3:15: cache.max_tokens: expected at least cache.tokens_per_block=64 tokens (got 32)",
        ),
        ("cache: 3\n", "{f}:1:8: cache: expected a mapping (got 3)"),
        ("variants:\n  - {set: {}}\n", "{f}:2:5: variants[0].name: required key is missing"),
        ("- 1\n- 2\n", "{f}:1:1: expected a mapping of workload keys (got [1, 2])"),
        ("name: t\n  bad: [1\n", "{f}:2:6: YAML syntax error: mapping values are not allowed in this context"),
        ("cache:\n  1: 2\n", "{f}:2:3: keys must be strings (got 1)"),
        ("name: ''\n", "{f}:1:7: name: expected at least 1 character (got '')"),
    ],
)
def test_bad_input_points_at_line_and_column(tmp_path, text, expected):
    path = write(tmp_path, text)
    assert error_of(path) == expected.format(f=path, cache_keys=CACHE_KEYS)


def test_unreadable_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    assert error_of(missing) == f"{missing}: cannot read: No such file or directory"
    assert error_of(tmp_path) == f"{tmp_path}: cannot read: is a directory"
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"name: \xff\n")
    assert error_of(binary).startswith(f"{binary}: cannot read: not UTF-8 text")


def test_merge_keys_and_aliases(tmp_path):
    text = (
        "variants:\n"
        "  - &v {name: a, set: {cache.max_tokens: 64}}\n"
        "  - <<: *v\n"
        "    name: b\n"
    )
    runs = load_workload(write(tmp_path, text)).variant_workloads()
    assert [(name, w.cache.max_tokens) for name, w in runs] == [("a", 64), ("b", 64)]
    path = write(tmp_path, "model: &m {num_layers: 2}\nhardware:\n  <<: *m\n")
    assert error_of(path) == (
        f"{path}:1:12: hardware.num_layers: unknown key; expected one of: preset, peak_flops,"
        " hbm_bandwidth, host_link_bandwidth, step_overhead_ms, profile"
    )


def test_exponent_floats_need_no_dot_or_sign(tmp_path):
    path = write(tmp_path, "hardware:\n  peak_flops: 989e12\n  hbm_bandwidth: 3.35e12\n")
    workload = load_workload(path, ["hardware.host_link_bandwidth=5e10"])
    assert workload.hardware.peak_flops == 989e12
    assert workload.hardware.hbm_bandwidth == 3.35e12
    assert workload.hardware.host_link_bandwidth == 5e10
    path = write(tmp_path, "cache:\n  max_tokens: 1e5\n")
    assert error_of(path) == f"{path}:2:15: cache.max_tokens: expected an integer (got 100000.0)"


@pytest.mark.parametrize(
    ("item", "expected"),
    [
        ("cache.max_tokens=4096", ("cache.max_tokens", 4096)),
        ("cache.enable_block_reuse=false", ("cache.enable_block_reuse", False)),
        ("model.attention_window=[1024, null]", ("model.attention_window", [1024, None])),
        ("name=a=b", ("name", "a=b")),
        (" run.seed = 3", ("run.seed", 3)),
        ("requests.path=", ("requests.path", None)),
    ],
)
def test_parse_set_is_yaml_typed(item, expected):
    assert parse_set(item) == expected


def test_parse_set_errors():
    with pytest.raises(InputError, match=r"^--set noequals: expected dotted.key=value$"):
        parse_set("noequals")
    with pytest.raises(InputError, match=r"^--set x=\[1,: YAML syntax error in value: did not find expected"):
        parse_set("x=[1,")


def test_apply_sets_copies_and_creates_sections():
    data = {"cache": {"max_tokens": 100}}
    result = apply_sets(data, ["cache.tokens_per_block=16", "run.seed=7"])
    assert result == {"cache": {"max_tokens": 100, "tokens_per_block": 16}, "run": {"seed": 7}}
    assert data == {"cache": {"max_tokens": 100}}
    assert apply_sets(data, {"cache.max_tokens": 5}) == {"cache": {"max_tokens": 5}}


def test_overrides_apply_after_the_file(tmp_path):
    path = write(tmp_path, "cache:\n  max_tokens: 1024\n")
    sets = ["cache.max_tokens=2048", "model.attention_window=[512, null]", "requests.synthetic.rate=.5"]
    workload = load_workload(path, sets)
    assert workload.cache.max_tokens == 2048
    assert workload.model.attention_window == [512, None]
    assert workload.requests.synthetic.rate == 0.5
    assert workload.source_text_sha256 == hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize(
    ("item", "expected"),
    [
        (
            "cache.max_tokenz=3",
            "--set cache.max_tokenz=3: unknown key cache.max_tokenz; expected one of: {cache_keys}",
        ),
        (
            "modle.x=1",
            "--set modle.x=1: unknown key modle.x; expected one of: " + TOP_KEYS,
        ),
        (
            "model.dtype.x=1",
            "--set model.dtype.x=1: unknown key model.dtype.x; model.dtype has no sub-keys",
        ),
        ("cache.max_tokens=lots", "--set cache.max_tokens: expected an integer (got 'lots')"),
        ("run.seed=true", "--set run.seed: expected an integer (got true)"),
        (
            "cache={tokens_per_block: 0}",
            "--set cache: cache.tokens_per_block: expected a value > 0 (got 0)",
        ),
        ("tune.n_trials=3", "--set tune.n_trials: tune.space: required key is missing"),
    ],
)
def test_override_errors_name_the_override(tmp_path, item, expected):
    path = write(tmp_path, "cache:\n  max_tokens: 1024\n")
    assert error_of(path, [item]) == expected.format(cache_keys=CACHE_KEYS)


def test_override_into_a_scalar_is_an_error(tmp_path):
    path = write(tmp_path, "requests: 3\n")
    assert error_of(path, ["requests.limit=2"]) == (
        "--set requests.limit=2: cannot set requests.limit: requests is not a mapping (got 3)"
    )


VARIANTS = """\
name: v
cache:
  max_tokens: 4096
variants:
  - name: batch
    set: {cache.add_sequence: batch}
  - name: small
    set:
      cache.max_tokens: 1024
      model.attention_window: [256, null]
"""


def test_variants_applied(tmp_path):
    workload = load_workload(write(tmp_path, VARIANTS), ["cache.tokens_per_block=16"])
    runs = workload.variant_workloads()
    assert [name for name, _ in runs] == ["batch", "small"]
    batch, small = (w for _, w in runs)
    assert batch.cache.max_tokens == 4096 and batch.variants == []
    assert small.cache.max_tokens == 1024
    assert small.model.layer_windows[:3] == [256, None, 256]
    assert small.cache.tokens_per_block == 16
    assert small.source_path == workload.source_path
    assert small.source_text_sha256 == workload.source_text_sha256
    assert workload.cache.max_tokens == 4096


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "variants:\n  - name: ok\n  - name: tiny\n    set: {cache.max_tokens: -5}\n",
            "{f}:3:5: variants[1] 'tiny': cache.max_tokens: expected a value > 0 (got -5)",
        ),
        (
            "variants:\n  - name: typo\n    set: {cache.max_tokenz: 5}\n",
            "{f}:2:5: variants[0] 'typo': unknown key cache.max_tokenz; expected one of: {cache_keys}",
        ),
        (
            "variants:\n  - name: trace\n    set: {requests.source: trace}\n",
            "{f}:2:5: variants[0] 'trace': requests.path: required when requests.source is 'trace'",
        ),
        (
            "variants:\n  - name: a\n  - name: a\n",
            "{f}:2:3: variants: duplicate variant name 'a' (variants[0] and variants[1])",
        ),
    ],
)
def test_variant_errors(tmp_path, text, expected):
    path = write(tmp_path, text)
    assert error_of(path) == expected.format(f=path, cache_keys=CACHE_KEYS)


TUNE = """\
tune:
  space:
    cache.tokens_per_block: {choices: [16, 32, 64]}
    cache.host_offload_ratio: {low: 0.0, high: 4.0, step: 0.5}
    scheduler.batch_wait_max_tokens_ratio: {low: 0.01, high: 1.0, log: true}
  constraints: ["ttft_ms.p99 <= 2000", " hit_rate>0.5 ", "wall_s < 1e3"]
  sampler: nsgaii
  n_trials: 8
"""


def test_tune_config(tmp_path):
    tune = load_workload(write(tmp_path, TUNE)).tune
    assert tune.space["cache.tokens_per_block"].choices == [16, 32, 64]
    assert tune.space["cache.host_offload_ratio"].step == 0.5
    assert tune.space["scheduler.batch_wait_max_tokens_ratio"].log is True
    assert [(o.metric, o.direction) for o in tune.objectives] == [
        ("throughput_tokens_per_s", "maximize"),
        ("peak_gpu_bytes", "minimize"),
    ]
    assert tune.parsed_constraints == [
        Constraint("ttft_ms.p99", "<=", 2000.0),
        Constraint("hit_rate", ">", 0.5),
        Constraint("wall_s", "<", 1000.0),
    ]


@pytest.mark.parametrize(
    ("space", "extra", "expected"),
    [
        (
            "    cache.max_tokenz: {choices: [1]}\n",
            "",
            "{f}:3:5: tune.space: unknown key cache.max_tokenz; expected one of: {cache_keys}",
        ),
        (
            "    cache.max_tokens: {choices: [1], low: 1}\n",
            "",
            "{f}:3:23: tune.space.cache.max_tokens: expected either choices or low/high/log/step, not both",
        ),
        (
            "    cache.max_tokens: {low: 1}\n",
            "",
            "{f}:3:23: tune.space.cache.max_tokens: expected either choices, or both low and high",
        ),
        (
            "    cache.max_tokens: {low: 9, high: 3}\n",
            "",
            "{f}:3:23: tune.space.cache.max_tokens: expected low < high (got low=9, high=3)",
        ),
        (
            "    cache.max_tokens: {low: 0, high: 3, log: true}\n",
            "",
            "{f}:3:23: tune.space.cache.max_tokens: expected low > 0 with log (got 0)",
        ),
        (
            "    cache.max_tokens: {low: x, high: 3}\n",
            "",
            "{f}:3:29: tune.space.cache.max_tokens.low: expected a number (got 'x')",
        ),
        (
            "    cache.max_tokens: {choices: []}\n",
            "",
            "{f}:3:33: tune.space.cache.max_tokens.choices: expected at least 1 item (got [])",
        ),
        (
            "    cache.max_tokens: {choices: [1]}\n",
            "  constraints: ['ttft_ms.p99 <= 2000', 'ttft_ms.p99 == 3']\n",
            "{f}:4:40: tune.constraints[1]: expected 'metric.path OP number' with OP one of <=, >=, <, >"
            " (got 'ttft_ms.p99 == 3')",
        ),
        (
            "    cache.max_tokens: {choices: [1]}\n",
            "  objectives: [{metric: hit_rate, direction: up}]\n",
            "{f}:4:46: tune.objectives[0].direction: expected one of 'maximize' or 'minimize' (got 'up')",
        ),
    ],
)
def test_tune_errors(tmp_path, space, extra, expected):
    path = write(tmp_path, "tune:\n  space:\n" + space + extra)
    assert error_of(path) == expected.format(f=path, cache_keys=CACHE_KEYS)


def test_json_schema_describes_every_field():
    schema = workload_json_schema()
    models = [schema, *schema["$defs"].values()]
    titles = {model["title"] for model in models}
    assert {"Workload", "ModelConfig", "CacheConfig", "TuneConfig", "SpaceEntry"} <= titles
    for model in models:
        assert model["additionalProperties"] is False, model["title"]
        for name, prop in model["properties"].items():
            assert prop.get("description"), f"{model['title']}.{name}"


def test_resolve_path(tmp_path):
    workload = load_workload(write(tmp_path, "requests: {source: trace, path: traces/a.jsonl}\n"))
    assert resolve_path(workload, workload.requests.path) == tmp_path / "traces/a.jsonl"
    assert resolve_path(workload, "/abs/t.jsonl") == Path("/abs/t.jsonl")
    assert resolve_path(Workload(), "rel.jsonl") == Path("rel.jsonl")


@pytest.mark.parametrize("path", sorted((Path(__file__).resolve().parents[1] / "workloads")
                                        .rglob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_workload_loads(path):
    """Each workload file the project ships validates with every variant (its trace, which may
    live outside the repository, is read by `kvbench validate`, not here)."""
    wl = load_workload(path)
    assert wl.variant_workloads()
