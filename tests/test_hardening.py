"""Hostile input and output paths (issue 14): each case exits 0 or 2 with one line, in bounded
time and memory, and output files are written where and how the user meant."""

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cli_helpers import run_cli
from kvbench.yamlsource import MAX_WORKLOAD_BYTES, MAX_YAML_NODES

TINY = """\
model: {num_layers: 2, num_kv_heads: 1, num_q_heads: 1, head_dim: 8}
cache: {tokens_per_block: 16, max_tokens: 1024}
requests:
  synthetic: {generator: shared_prefix, num_requests: 20, system_prompt_tokens: 32,
              prompt_tokens: 16, num_users: 4, output_tokens: 4}
run: {seed: 1, progress: false}
"""


@pytest.fixture
def tiny(tmp_path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY)
    return path


def replace_sections(text: str, extra: str) -> str:
    """`text` with its top-level sections that `extra` names replaced by `extra`'s (a key
    given twice is an error)."""
    def sections(t):
        out = []
        for line in t.splitlines():
            if line[:1].strip():
                out.append([line])
            else:
                out[-1].append(line)
        return {s[0].split(":")[0]: "\n".join(s) for s in out}
    merged = sections(text) | sections(extra)
    return "\n".join(merged.values()) + "\n"


def one_error(code: int, err: str, expected_code: int = 2) -> str:
    """The single stderr line of a refused input."""
    assert code == expected_code, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err and "Error:" not in lines[0].split(": error: ", 1)[-1][:40]
    assert lines[0].startswith("kvbench: error: ")
    return lines[0][len("kvbench: error: "):]


# --- 1. bounded YAML -----------------------------------------------------------------------------


def alias_bomb(levels: int = 9, under: str = "junk") -> str:
    lines = [f"{under}:", "  a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    for i in range(1, levels):
        lines.append(f"  a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("under", ["junk", "tune"])
def test_alias_bomb_is_refused_at_once(tmp_path, capsys, under):
    path = tmp_path / "bomb.yaml"
    path.write_text(alias_bomb(under=under))
    assert path.stat().st_size < 600
    code, _, err = run_cli(["validate", path], capsys)
    assert one_error(code, err) == (
        f"{path}:7:7: aliases expand the document past {MAX_YAML_NODES:,} values "
        "(an alias bomb?)")


def test_aliases_within_the_bound_still_work(tmp_path, capsys):
    path = tmp_path / "ok.yaml"
    path.write_text(TINY + "variants:\n  - &v {name: a, set: {cache.max_tokens: 512}}\n"
                    "  - {<<: *v, name: b}\n")
    code, out, err = run_cli(["validate", path], capsys)
    assert code == 0, err
    assert "variants: a, b" in out


@pytest.mark.parametrize(("text", "where", "message"), [
    ("model: " + "[" * 40 + "]" * 40 + "\n", "1:39", "nested deeper than 32 levels"),
    ("model: " + "[" * 20000 + "]" * 20000 + "\n", "1:1007",
     "YAML syntax error: exceeded maximum nesting depth"),
    ("a: &a [*a]\n", "1:4", "an alias here refers to a node that contains it"),
])
def test_deep_or_recursive_yaml(tmp_path, capsys, text, where, message):
    path = tmp_path / "w.yaml"
    path.write_text(text)
    code, _, err = run_cli(["validate", path], capsys)
    assert one_error(code, err) == f"{path}:{where}: {message}"


def test_oversized_file_is_refused_before_parsing(tmp_path, capsys):
    path = tmp_path / "big.yaml"
    path.write_text("model:\n  attention_window: [" + ", ".join(["1"] * 400_000) + "]\n")
    assert path.stat().st_size < 2**20 * 1.2
    code, _, err = run_cli(["validate", path], capsys)
    assert one_error(code, err).startswith(
        f"{path}: {path.stat().st_size:,} bytes; a workload file holds at most "
        f"{MAX_WORKLOAD_BYTES // 1024} KiB")


def test_set_value_is_bounded_too(tiny, capsys):
    bomb = "[" * 40 + "]" * 40
    code, _, err = run_cli(["validate", tiny, "--set", f"model.attention_window={bomb}"], capsys)
    assert one_error(code, err) == "--set model.attention_window: nested deeper than 32 levels"


# --- 2. output files -----------------------------------------------------------------------------


def test_json_to_a_device_fifo_or_directory_is_refused_before_the_run(tiny, tmp_path, capsys):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for target, kind in (("/dev/null", "a character device"), (tmp_path, "a directory"),
                         (fifo, "a fifo")):
        code, out, err = run_cli(["run", tiny, "--json", target], capsys)
        assert one_error(code, err) == (
            f"--json {target}: cannot write: {kind}, not a regular file (give a file path, "
            "or - for standard output)")
        assert out == ""  # refused before the run: no tables
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


@pytest.mark.parametrize("option", ["--json", "--update-baseline"])
def test_symlink_is_written_through(tiny, tmp_path, capsys, option):
    target = tmp_path / "data" / "real.json"
    target.parent.mkdir()
    target.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    replace = ["--replace"] if option == "--update-baseline" else []
    code, _, err = run_cli(["run", tiny, option, link, "-q", *replace], capsys)
    assert code == 0, err
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert json.loads(target.read_text())["schema_version"] == 1
    assert [p.name for p in target.parent.iterdir()] == ["real.json"]  # no temporary left


def test_a_baseline_to_merge_into_is_read_before_the_run(tiny, tmp_path, capsys):
    baseline = tmp_path / "b.json"
    baseline.write_text("old")
    code, out, err = run_cli(["run", tiny, "--update-baseline", baseline], capsys)
    assert one_error(code, err) == f"{baseline}:1:1: not JSON: Expecting value"
    assert out == ""


def test_new_file_honours_the_umask_and_an_existing_one_keeps_its_mode(tiny, tmp_path, capsys):
    old = os.umask(0o027)
    try:
        code, _, err = run_cli(["run", tiny, "--json", tmp_path / "new.json", "-q"], capsys)
    finally:
        os.umask(old)
    assert code == 0, err
    assert stat.S_IMODE((tmp_path / "new.json").stat().st_mode) == 0o640
    kept = tmp_path / "kept.json"
    kept.write_text("{}")
    kept.chmod(0o604)
    assert run_cli(["run", tiny, "--json", kept, "-q"], capsys)[0] == 0
    assert stat.S_IMODE(kept.stat().st_mode) == 0o604


def test_json_dash_writes_standard_output(tiny, capsys):
    code, out, err = run_cli(["run", tiny, "--json", "-"], capsys)
    assert code == 0, err
    assert json.loads(out)["runs"][0]["variant"] == "default"
    assert "Reuse" in err  # the tables move to stderr


def test_trace_stats_json(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"timestamp": 0, "input_length": 600, "output_length": 3,
                                 "hash_ids": [0, 1]}) + "\n")
    code, out, _ = run_cli(["trace", "stats", trace, "--json", "-"], capsys)
    assert code == 0 and json.loads(out)["requests"] == 1
    code, _, err = run_cli(["trace", "stats", trace, "--json", tmp_path], capsys)
    assert one_error(code, err).startswith(f"--json {tmp_path}: cannot write: a directory")


def test_trace_convert_output(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"timestamp": 0, "input_length": 600, "output_length": 3,
                                 "hash_ids": [0, 1]}) + "\n")
    code, out, _ = run_cli(["trace", "convert", trace, "-", "-q"], capsys)
    assert code == 0 and json.loads(out)["hash_ids"] == [0, 1]
    code, _, err = run_cli(["trace", "convert", trace, tmp_path], capsys)
    assert one_error(code, err).startswith(
        f"trace convert OUTPUT {tmp_path}: cannot write: a directory")


def test_tune_outputs_are_checked_before_the_study(tiny, tmp_path, capsys):
    tiny.write_text(TINY + "tune:\n  space: {cache.tokens_per_block: {choices: [16, 32]}}\n"
                    "  objectives: [{metric: hit_rate, direction: maximize}]\n")
    db = tmp_path / "t.db"
    code, _, err = run_cli(["tune", tiny, "-n", "1", "-q", "--storage", f"sqlite:///{db}",
                            "--export-best", tmp_path], capsys)
    assert one_error(code, err).startswith(f"--export-best {tmp_path}: cannot write: a directory")
    code, _, err = run_cli(["tune", tiny, "-n", "1", "-q", "--storage", f"sqlite:///{db}",
                            "--plots", tiny], capsys)
    assert one_error(code, err) == (
        f"--plots {tiny}: cannot write into it: a file, not a folder")
    assert not db.exists()  # refused before the study was opened


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_unwritable_folder_is_refused_before_the_run(tiny, tmp_path, capsys):
    folder = tmp_path / "ro"
    folder.mkdir(mode=0o555)
    code, out, err = run_cli(["run", tiny, "--json", folder / "r.json"], capsys)
    assert one_error(code, err) == (
        f"--json {folder / 'r.json'}: cannot write: folder {folder} is not writable")


def test_markdown_and_report_outputs_are_checked(tiny, tmp_path, capsys):
    result = tmp_path / "r.json"
    assert run_cli(["run", tiny, "--json", result, "-q"], capsys)[0] == 0
    code, _, err = run_cli(["compare", result, result, "--markdown", tmp_path, "-q"], capsys)
    assert one_error(code, err).startswith(f"--markdown {tmp_path}: cannot write: a directory")
    code, out, _ = run_cli(["compare", result, result, "--markdown", "-", "-q"], capsys)
    assert code == 0 and out.startswith("#")
    code, _, err = run_cli(["report", result, "--out", result], capsys)
    assert one_error(code, err) == (
        f"--out {result}: cannot write into it: a file, not a folder")


# --- 5. validate refuses what run refuses -------------------------------------------------------


@pytest.mark.parametrize(("extra", "expected"), [
    ("requests: {source: trace, path: nope.jsonl}",
     "{d}/nope.jsonl: cannot read trace: No such file or directory"),
    ("requests: {source: trace, path: bad.jsonl}", "{d}/bad.jsonl:2: invalid JSON at column 2"),
    ("cache: {tokens_per_block: 16, max_tokens: 16}",
     "{w}: cache.max_tokens: request 2 needs 5 blocks"),
    ("run: {mode: serve}\nscheduler: {max_num_tokens: 8, max_batch_size: 16}",
     "{w}: scheduler.max_batch_size (16) exceeds scheduler.max_num_tokens (8)"),
    ("requests:\n  encoder: {tokens: 100}\n  synthetic: {num_requests: 4, prompt_tokens: 16,"
     " system_prompt_tokens: 16, output_tokens: 4}",
     "{w}: cache.cross_kv_cache_fraction: an encoder input of 100 tokens needs 7 "
     "cross-attention blocks but the fraction (0.0) of cache.max_tokens gives 0"),
])
def test_validate_refuses_what_run_refuses(tmp_path, capsys, extra, expected):
    (tmp_path / "bad.jsonl").write_text(
        json.dumps({"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [0, 1]})
        + "\n{oops\n")
    path = tmp_path / "w.yaml"
    path.write_text(replace_sections(TINY, extra))
    messages = []
    for command in (["validate"], ["run", "-q"]):
        code, _, err = run_cli([*command, path], capsys)
        messages.append(one_error(code, err))
    assert messages[0] == messages[1]
    assert messages[0].startswith(expected.format(d=tmp_path, w=path))


def test_validate_takes_several_files(tiny, tmp_path, capsys):
    other = tmp_path / "other.yaml"
    other.write_text(TINY.replace("seed: 1", "seed: 2"))
    code, out, _ = run_cli(["validate", tiny, other], capsys)
    assert code == 0
    assert out.splitlines() == [f"{tiny}: ok (cache mode; variants: default)",
                                f"{other}: ok (cache mode; variants: default)"]


def test_validate_checks_a_tune_section_as_tune_would(tiny, capsys):
    tiny.write_text(TINY + "tune:\n  space: {cache.tokens_per_block: {choices: [16, 32]}}\n"
                    "  objectives: [{metric: hit_rat, direction: maximize}]\n")
    assert one_error(*run_cli(["validate", tiny], capsys)[::2]).startswith(
        f"{tiny}:9:25: tune.objectives[0].metric: unknown metric 'hit_rat'; did you mean "
        "hit_rate")
    assert run_cli(["run", tiny, "-q"], capsys)[0] == 0  # run ignores the tune section


# --- 6. exit 2 with a location -------------------------------------------------------------------


@pytest.mark.parametrize(("sets", "expected"), [
    (["model.attention_window=100000000000000000000"],
     "--set model.attention_window: expected a positive integer up to 2147483647"),
    (["model.attention_window=[5, 6, 7]"],
     "--set model.attention_window: expected at most model.num_layers=2 entries"),
    (["cache.host_offload_ratio=1e9"],
     "--set cache.host_offload_ratio: expected a value <= 1024 (got 1000000000.0)"),
    (["cache.host_offload_ratio=1024", "cache.max_tokens=67108864"],
     "{w}: the cache manager's block metadata would take"),
    (["requests.synthetic.num_requests=100000000000"],
     "{w}: the synthetic requests' tokens would take"),
])
def test_sizes_are_checked_before_allocating(tiny, capsys, sets, expected):
    args = [a for s in sets for a in ("--set", s)]
    for command in ("validate", "run"):
        code, _, err = run_cli([command, tiny, *args], capsys)
        assert one_error(code, err).startswith(expected.format(w=tiny))


def test_data_plane_tensors_are_sized_first(tiny, capsys):
    pytest.importorskip("torch")
    code, _, err = run_cli(["run", tiny, "--set", "run.backend=torch", "--set",
                            f"cache.tokens_per_block={2**30}", "--set",
                            f"cache.max_tokens={2**30}"], capsys)
    assert "K/V tensors" in one_error(code, err)


def test_gpu_cache_larger_than_the_preset_warns(tiny, capsys):
    code, _, err = run_cli(["validate", tiny, "--set", "model.num_layers=64", "--set",
                            "model.head_dim=4096", "--set", "cache.max_tokens=1048576"], capsys)
    assert code == 0
    assert err.strip() == (
        f"kvbench: warning: {tiny}: cache.max_tokens: the GPU cache takes 1,024.0 GiB but a "
        "H100-SXM has 79.6 GiB in all (variants: default)")


@pytest.mark.parametrize("command", ["run", "validate"])
def test_a_cache_refused_for_its_size_is_one_error_without_the_preset_warning(
        tiny, capsys, command):
    """The GPU-size warning is for a workload that runs: where the block metadata would not
    fit this machine either, the error is the only line."""
    code, _, err = run_cli([command, tiny, "--set", "cache.max_tokens=100000000000"], capsys)
    message = one_error(code, err)
    assert "block metadata would take" in message and "(variant" not in message


def test_a_variant_refused_before_it_runs_is_named(tiny, capsys):
    """Variants differ in what makes a run fit: the error names the variant refused."""
    tiny.write_text(tiny.read_text() + "variants:\n  - {name: small, set: {}}\n"
                    "  - {name: huge, set: {cache.max_tokens: 100000000000}}\n")
    code, _, err = run_cli(["validate", tiny], capsys)
    message = one_error(code, err)
    assert "block metadata would take" in message and message.endswith(" (variant huge)")


def test_the_preset_warning_comes_once_per_workload_run(tiny, capsys):
    code, _, err = run_cli(["run", tiny, "--quiet", "--repeat", "2", "--set",
                            "model.num_layers=64", "--set", "model.head_dim=4096", "--set",
                            "cache.max_tokens=1048576"], capsys)
    assert code == 0 and err.count("the GPU cache takes 1,024.0 GiB") == 1, err


@pytest.mark.parametrize("order", [("big", "huge"), ("huge", "big")])
def test_a_variant_refused_for_its_size_gets_no_preset_warning(tmp_path, capsys, order):
    """The warning of a variant refused for its size would only repeat its error: a run warns
    about the variants checked (those that run), once over --repeat, and never about the one
    the error refuses (it warned about every variant once the first was checked)."""
    sizes = {"big": 1048576, "huge": 100000000000}
    path = tmp_path / "v.yaml"
    path.write_text(replace_sections(TINY, "model: {num_layers: 64, num_kv_heads: 1, "
                                           "num_q_heads: 1, head_dim: 4096}\n")
                    + "variants:\n" + "".join(f"  - {{name: {n}, set: {{cache.max_tokens: "
                                               f"{sizes[n]}}}}}\n" for n in order))
    code, _, err = run_cli(["run", path, "--quiet", "--repeat", "2"], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and "block metadata would take" in lines[-1], err
    warned = [line for line in lines if "kvbench: warning:" in line]
    assert warned == ([f"kvbench: warning: {path}: cache.max_tokens: the GPU cache takes "
                       "1,024.0 GiB but a H100-SXM has 79.6 GiB in all (variants: big)"]
                      if order[0] == "big" else []), err
    assert "variants: huge" not in err

def test_report_on_a_non_numeric_metric_leaves_nothing(tiny, tmp_path, capsys):
    result = tmp_path / "r.json"
    assert run_cli(["run", tiny, "--json", result, "-q"], capsys)[0] == 0
    data = json.loads(result.read_text())
    data["runs"][0]["metrics"]["hit_rate"] = "high"
    result.write_text(json.dumps(data))
    out_dir = tmp_path / "rep"
    code, _, err = run_cli(["report", result, "--out", out_dir], capsys)
    assert one_error(code, err) == (
        f"{result}: run tiny/default: metric hit_rate: expected a finite number, got 'high'")
    assert not out_dir.exists() or not any(out_dir.iterdir())


@pytest.mark.parametrize(("storage", "expected"), [
    ("journal:{d}", "--storage journal:{d}: expected a journal file, not a folder"),
    ("foo://bar", "--storage foo://bar: unknown database 'foo'; expected sqlite:///FILE"),
])
def test_bad_tune_storage(tmp_path, capsys, storage, expected):
    path = tmp_path / "t.yaml"
    path.write_text(TINY + "tune:\n  space: {cache.tokens_per_block: {choices: [16, 32]}}\n"
                    "  objectives: [{metric: hit_rate, direction: maximize}]\n")
    code, _, err = run_cli(["tune", path, "-n", "1", "-q", "--storage",
                            storage.format(d=tmp_path)], capsys)
    assert one_error(code, err).startswith(expected.format(d=tmp_path))


# --- paper cuts ----------------------------------------------------------------------------------


def test_verify_off_is_the_word_off(tiny, capsys):
    from kvbench.config import load_workload

    assert load_workload(tiny, ["run.verify=off"]).run.verify == "off"
    text = TINY.replace("progress: false", "progress: false, verify: off")
    tiny.write_text(text)
    assert load_workload(tiny).run.verify == "off"


TRACE_WORKLOAD = """\
model: {num_layers: 2, num_kv_heads: 1, num_q_heads: 1, head_dim: 8}
requests: {source: trace, path: t.jsonl}
"""


@pytest.mark.parametrize(("text", "item", "expected"), [
    (TRACE_WORKLOAD, "requests.synthetic.rate=3",
     "requests.synthetic is not used: this workload reads requests from a trace"
     " (requests.source: trace)"),
    (TINY, "scheduler.max_num_tokens=64",
     "the scheduler is not used in run.mode: cache (it runs in serve mode)"),
])
def test_set_into_an_unused_section_is_an_error(tmp_path, capsys, text, item, expected):
    path = tmp_path / "w.yaml"
    path.write_text(text)
    code, _, err = run_cli(["validate", path, "--set", item], capsys)
    assert one_error(code, err) == f"--set {item}: {expected}"


def test_set_into_a_section_some_variant_uses_is_fine(tiny, capsys):
    tiny.write_text(TINY + "variants:\n  - {name: c}\n  - {name: s, set: {run.mode: serve}}\n")
    code, _, err = run_cli(["validate", tiny, "--set", "scheduler.max_num_tokens=64",
                            "--set", "scheduler.max_batch_size=8"], capsys)
    assert code == 0, err


def test_variant_columns_show_what_ran(tiny, capsys):
    tiny.write_text(TINY + "variants:\n  - {name: tpb-16}\n"
                    "  - {name: tpb-32, set: {cache.tokens_per_block: 32}}\n")
    code, out, _ = run_cli(["run", tiny, "--set", "cache.tokens_per_block=8"], capsys)
    assert code == 0
    assert "tokens_per_block=8" in out and "tokens_per_block=32" in out
    assert "--set applies to every variant; a variant's own set wins" in out


def test_tables_never_fold_a_number_when_piped(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "60")
    path = tmp_path / "w.yaml"
    path.write_text(TINY.replace("run: {seed: 1", "run: {mode: serve, seed: 1"))
    code, out, _ = run_cli(["run", path], capsys)
    assert code == 0
    ttft = [line for line in out.splitlines() if "TTFT" in line]
    assert len(ttft) == 1 and ttft[0].count(" / ") == 3  # all four numbers on one line
    titles = [line.strip() for line in out.splitlines() if line.startswith("w: ")]
    assert "w: Serving" in titles


def test_memory_rows_are_named_for_sizing(tiny, capsys):
    code, out, _ = run_cli(["run", tiny], capsys)
    assert code == 0
    for label in ("GPU cache size (blocks)", "GPU cache size (bytes)",
                  "GPU blocks peak (in use)", "GPU bytes peak (in use)"):
        assert label in out


def test_version_help_examples_and_flags(capsys):
    from kvbench import __version__

    code, out, _ = run_cli(["--version"], capsys)
    assert (code, out.strip()) == (0, f"kvbench {__version__}")
    for command in (["run"], ["validate"], ["schema"], ["tune"], ["compare"], ["report"],
                    ["trace", "stats"], ["trace", "convert"]):
        code, out, _ = run_cli([*command, "--help"], capsys)
        assert code == 0
        assert "Examples:" in out and f"kvbench {' '.join(command)}" in out.split("Examples:")[1]
        assert "<bool>" not in out


def test_ctrl_c_says_interrupted(tmp_path):
    path = tmp_path / "w.yaml"
    path.write_text(TINY.replace("num_requests: 20", "num_requests: 2000000")
                    .replace("max_tokens: 1024", "max_tokens: 65536"))
    proc = subprocess.Popen([sys.executable, "-c", "from kvbench.cli import main; main()",
                             "run", str(path), "-q"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            # as in a terminal: a job started in the background of a
                            # non-interactive shell (CI runners do this) inherits SIGINT ignored
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    time.sleep(3)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert err.strip().splitlines()[-1] == "kvbench: interrupted"


def test_shared_prefix_prompt_tokens_are_the_new_tokens():
    from types import SimpleNamespace

    from kvbench.traffic import generate

    cfg = SimpleNamespace(generator="shared_prefix", num_requests=400, system_prompt_tokens=100,
                          prompt_tokens=50, prompt_tokens_spread=0.5, output_tokens=10,
                          num_users=4, turns=1, arrival="burst", rate=1.0, vocab_size=1000,
                          profile_tokens=20)
    lengths = [r.input_length for r in generate(cfg, 0)]
    new = [n - 100 - 20 for n in lengths]
    assert 45 < sum(new) / len(new) < 55 and min(new) >= 25 and max(new) <= 75


def test_csv_trace_mixing_seconds_and_dates_is_bad_input(tmp_path, capsys):
    # Found by the fuzz: comparing a date with a number raised TypeError (exit 1).
    trace = tmp_path / "t.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n5,422,41\n"
                     "2023-11-16 18:00:07.0000000,550,79\n")
    code, _, err = run_cli(["trace", "stats", trace], capsys)
    assert one_error(code, err) == (
        f"{trace}:3: 'TIMESTAMP' '2023-11-16 18:00:07.0000000': expected seconds like the rows "
        "before")


@pytest.mark.parametrize(("name", "text"), [
    ("t.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n5,422,999999999999999999999999\n"),
    ("t.jsonl", json.dumps({"timestamp": 0, "input_length": 600, "output_length": 2**70,
                            "hash_ids": [0, 1]}) + "\n"),
])
def test_trace_output_lengths_are_bounded(tmp_path, capsys, name, text):
    # Found by the fuzz: an output length past int64 overflowed trace stats (exit 1).
    trace = tmp_path / name
    trace.write_text(text)
    code, _, err = run_cli(["trace", "stats", trace], capsys)
    assert "must be in [0, 16777215]" in one_error(code, err)


@pytest.mark.parametrize("change", [
    {"environment": 1.0}, {"workloads": [{"name": []}]}, {"workload": {"name": [1]}},
])
def test_compare_refuses_results_of_the_wrong_shape(tiny, tmp_path, capsys, change):
    # Found by the fuzz: each of these raised AttributeError or TypeError (exit 1).
    result = tmp_path / "r.json"
    assert run_cli(["run", tiny, "--json", result, "-q"], capsys)[0] == 0
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**json.loads(result.read_text()), **change}))
    code, _, err = run_cli(["compare", result, bad, "-q"], capsys)
    assert one_error(code, err).startswith(f"{bad}: ")


def test_a_run_with_a_list_for_its_workload_name_is_refused(tiny, tmp_path, capsys):
    result = tmp_path / "r.json"
    assert run_cli(["run", tiny, "--json", result, "-q"], capsys)[0] == 0
    data = json.loads(result.read_text())
    data["runs"][0]["workload"] = ["x"]
    result.write_text(json.dumps(data))
    code, _, err = run_cli(["report", result, "--out", tmp_path / "rep"], capsys)
    assert one_error(code, err).startswith(f"{result}: runs[0]: expected an object")


def test_cli_runs_on_a_typer_without_the_help_hook():
    # A GPU machine's typer had no TyperOption.display_type_rich and every command died on
    # import; the help tweak must be optional.
    code = ("import typer.core\n"
            "for k in typer.core.TyperOption.__mro__:\n"
            "    if 'display_type_rich' in vars(k): delattr(k, 'display_type_rich')\n"
            "import sys; sys.argv = ['kvbench', 'validate', 'workloads/quickstart.yaml']; "
            "from kvbench.cli import main; main()")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=Path(__file__).parent.parent, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr


def test_python_dash_m_kvbench_is_the_command(tmp_path):
    """`python -m kvbench` runs the CLI, exit codes included (bad input: one line, exit 2)."""
    path = tmp_path / "w.yaml"
    text = TINY.replace("tokens_per_block: 16", "tokens_per_block: -3")
    path.write_text(text)
    line = text.splitlines()[1]
    proc = subprocess.run([sys.executable, "-m", "kvbench", "validate", str(path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"kvbench: error: {path}:2:{line.index('-3') + 1}: cache.tokens_per_block: "
        "expected a value > 0 (got -3)"]


# --- found by fuzzing every input (round 2) ------------------------------------------------------


@pytest.mark.parametrize(("sets", "expected"), [
    (["cache.host_offload_ratio=.inf"], "--set cache.host_offload_ratio: expected a finite "
                                        "number (got Infinity)"),
    (["cache.eviction_policy=gdsf", "cache.policy.gdsf.freq_weight=.inf"],
     "--set cache.policy.gdsf.freq_weight: expected a finite number (got Infinity)"),
    (["cache.eviction_policy=predictive", "cache.policy.predictive.boost=.nan"],
     "--set cache.policy.predictive.boost: expected a finite number (got NaN)"),
    (["cache.eviction_policy=lru2", "cache.policy.lru2.history_ratio=1e308"],
     "--set cache.policy.lru2.history_ratio: expected a value <= 1024 (got 1e+308)"),
    (["run.seed=-1"], "--set run.seed: expected a value >= 0 (got -1)"),
])
def test_values_that_would_overflow_are_bad_input(tiny, capsys, sets, expected):
    args = ["run", tiny, "-q"]
    for s in sets:
        args += ["--set", s]
    assert one_error(*run_cli(args, capsys)[::2]) == expected


def test_a_fifo_is_refused_without_opening_it(tiny, tmp_path, capsys):
    """Opening a fifo blocks until a writer comes: every input a user names is checked to be
    a regular file first (the alarm fails the test instead of hanging it)."""
    fifo = tmp_path / "f"
    os.mkfifo(fifo)
    good = tmp_path / "r.json"
    assert run_cli(["run", tiny, "-q", "--json", good], capsys)[0] == 0

    def hung(*_):
        raise AssertionError("blocked opening a fifo")
    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(20)
    try:
        for args, what in ((["run", tiny, "-q", "--set", "requests.source=trace", "--set",
                             f"requests.path={fifo}"], " trace"),
                           (["trace", "stats", fifo], " trace"), (["run", fifo], ""),
                           (["compare", fifo, good], ""), (["compare", good, fifo], "")):
            code, _, err = run_cli(args, capsys)
            assert one_error(code, err) == f"{fifo}: cannot read{what}: not a regular file"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def test_a_result_nested_too_deeply_is_bad_input(tiny, tmp_path, capsys):
    good, deep = tmp_path / "r.json", tmp_path / "deep.json"
    assert run_cli(["run", tiny, "-q", "--json", good], capsys)[0] == 0
    deep.write_text("[" * 100000 + "]" * 100000)
    assert one_error(*run_cli(["compare", good, deep], capsys)[::2]) == (
        f"{deep}: JSON nested too deeply to be a kvbench result")


def test_a_key_given_twice_is_an_error_where_a_merge_may_override(tmp_path, capsys):
    """YAML forbids a key twice in one mapping (PyYAML would keep the last silently); a key a
    `<<` merge brings may still be overridden."""
    path = tmp_path / "w.yaml"
    path.write_text(TINY.replace("cache: {tokens_per_block: 16, max_tokens: 1024}",
                                 "cache:\n  max_tokens: 1024\n  tokens_per_block: 16\n"
                                 "  max_tokens: 2048"))
    assert one_error(*run_cli(["validate", path], capsys)[::2]) == (
        f"{path}:5:3: duplicate key 'max_tokens' (first at line 3)")
    code, _, err = run_cli(["validate", path, "--set", "cache={max_tokens: 1, max_tokens: 2}"],
                           capsys)
    assert code == 2 and "duplicate key 'max_tokens'" in err
    path.write_text(TINY.replace("cache: {tokens_per_block: 16, max_tokens: 1024}",
                                 "cache: {<<: {tokens_per_block: 16, max_tokens: 1024}, "
                                 "max_tokens: 2048}"))
    out = tmp_path / "r.json"
    assert run_cli(["run", path, "-q", "--json", out], capsys)[0] == 0
    assert json.loads(out.read_text())["runs"][0]["config"]["cache"]["max_tokens"] == 2048


@pytest.mark.parametrize(("args", "expected"), [
    (["tune", "{w}", "--holdout", "abc"], "Invalid value for '--holdout': Input should be a "
                                          "valid number, unable to parse string as a number"),
    (["run", "--bogus", "{w}"], "No such option: --bogus"),
    (["compare"], "Missing argument 'base'."),
])
def test_a_command_line_that_does_not_parse_is_one_line(tiny, capsys, args, expected):
    code, _, err = run_cli([a.format(w=tiny) for a in args], capsys)
    assert one_error(code, err).startswith(expected + " (see ")
    code, out, err = run_cli([], capsys)  # no arguments: the help, as before
    assert code == 2 and "Usage" in out and not err


def test_a_tuned_value_the_key_cannot_take_is_refused_before_the_study(tiny, tmp_path, capsys):
    tiny.write_text(TINY + "tune:\n  space: {cache.tokens_per_block: {choices: [16, -5]}}\n"
                    "  objectives: [{metric: hit_rate, direction: maximize}]\n")
    code, _, err = run_cli(["tune", tiny, "--storage", f"sqlite:///{tmp_path}/s.db"], capsys)
    assert one_error(code, err) == (
        f"{tiny}:8:50: tune.space.cache.tokens_per_block.choices[1]: not a value of "
        "cache.tokens_per_block: expected a value > 0 (got -5)")
    assert not (tmp_path / "s.db").exists()
