import copy
import json
import sys
from pathlib import Path

import pytest

from kvbench.results import merge_repeats
from kvbench.config import load_workload
from kvbench.report.page import write_report
from kvbench.report.plots import PLOT_KINDS, plot_bars, plot_blocks, plot_hit_rate
from kvbench.results import build_result
from kvbench.runner import run_workload

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

TINY = """\
name: tiny report
cache: {tokens_per_block: 16, max_tokens: 1024}
requests:
  synthetic: {generator: shared_prefix, num_requests: 50, system_prompt_tokens: 64,
              prompt_tokens: 48, num_users: 8}
run: {seed: 5, progress: false}
variants:
  - {name: partial, set: {}}
  - {name: tpb 32, set: {cache.tokens_per_block: 32}}
"""


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    path = tmp_path_factory.mktemp("wl") / "tiny.yaml"
    path.write_text(TINY)
    return build_result([run_workload(load_workload(path))])


def assert_png(path: Path) -> None:
    assert path.is_file() and path.stat().st_size > 1000
    assert path.read_bytes()[:8] == PNG_MAGIC


def test_every_plot_kind_is_written_and_non_empty(result, tmp_path):
    written = write_report(result, tmp_path)
    assert {p.name for p in written} == {p.name for p in tmp_path.iterdir()}
    pngs = sorted(p.name for p in written if p.suffix == ".png")
    assert pngs == [
        "tiny-report--bars.png",
        "tiny-report--partial--blocks.png",
        "tiny-report--partial--hit_rate.png",
        "tiny-report--tpb-32--blocks.png",
        "tiny-report--tpb-32--hit_rate.png",
    ]
    assert {name.rsplit("--", 1)[1][:-4] for name in pngs} == set(PLOT_KINDS)
    for name in pngs:
        assert_png(tmp_path / name)
    page, md = (tmp_path / "index.html").read_text(), (tmp_path / "index.md").read_text()
    for name in pngs:
        assert f'src="{name}"' in page and f"({name})" in md
    assert "hit rate" in page and "| hit rate |" in md


def serve_like(result: dict) -> dict:
    """The result with serve-mode metrics, a host tier in the timeline and no per-request
    hit columns: what serve mode and the host tier will add."""
    serve = copy.deepcopy(result)
    for i, run in enumerate(serve["runs"]):
        m = run["metrics"]
        m.update(time_source="modeled", mnt_overflow_steps=i, throughput_tokens_per_s=900.0 + i,
                 ttft_ms={"mean": 5.0, "p50": 4.0, "p90": 9.0, "p99": 12.0 + i},
                 tpot_ms={"mean": 1.0, "p50": 1.0, "p90": 1.5, "p99": 2.0}, host_blocks_total=16)
        cols = run["timeline"]["columns"]
        del cols["reused_tokens"], cols["prompt_tokens"]
        n = len(cols["free"])
        cols.update(host_in_use=[0] * n, host_cached=[j % 16 for j in range(n)],
                    host_free=[16 - j % 16 for j in range(n)])
        run["timeline"]["x"] = "step"
    return serve


def test_serve_and_host_results_plot_what_they_have(result, tmp_path):
    runs = list(merge_repeats(serve_like(result)).values())
    run = runs[0]
    assert_png(plot_blocks(run, tmp_path / "blocks.png"))
    assert plot_hit_rate(run, tmp_path / "hit.png") is None
    assert_png(plot_bars("serve", runs, tmp_path / "bars.png"))


def test_kvbench_report_command(result, tmp_path, capsys):
    from kvbench import cli

    path = tmp_path / "result.json"
    path.write_text(json.dumps(result))
    old = sys.argv
    sys.argv = ["kvbench", "report", str(path), "-q"]
    try:
        cli.main()
    except SystemExit as exc:
        assert not exc.code
    finally:
        sys.argv = old
    out_dir = tmp_path / "result-report"
    assert (out_dir / "index.html").is_file()
    assert len(list(out_dir.glob("*.png"))) == 5
