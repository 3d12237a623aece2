"""results.py owns the result JSON; compare and report load neither the engine, the cache,
the workload config, numpy nor torch."""

import json
import subprocess
import sys
from pathlib import Path

from kvbench.metrics import METRICS
from kvbench.results import result_json_schema

ROOT = Path(__file__).resolve().parents[1]
BASELINE = ROOT / "results" / "baseline-cpu.json"
HEAVY = ("kvbench.engine", "kvbench.cache", "kvbench.runner", "kvbench.config",
         "kvbench.kernels", "kvbench.traffic", "numpy", "torch", "pydantic", "yaml")

_PROBE = """
import atexit, sys
def report():
    heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('numpy', 'torch', 'pydantic',
                   'yaml') or m.startswith(('kvbench.engine', 'kvbench.cache', 'kvbench.runner',
                   'kvbench.config', 'kvbench.kernels', 'kvbench.traffic')))
    sys.__stderr__.write('LOADED ' + ' '.join(heavy) + '\\n')
atexit.register(report)
"""


def _loaded(code: str) -> set[str]:
    proc = subprocess.run([sys.executable, "-c", _PROBE + code], capture_output=True, text=True,
                          timeout=120)
    line = [ln for ln in proc.stderr.splitlines() if ln.startswith("LOADED")][-1]
    return set(line.split()[1:])


def _top(names: set[str]) -> set[str]:
    return {n for n in names if any(n == h or n.startswith(h + ".") for h in HEAVY)}


def test_importing_compare_and_report_loads_nothing_heavy():
    assert _top(_loaded("import kvbench.compare, kvbench.report.page, kvbench.results")) == set()


def test_the_compare_command_loads_nothing_heavy():
    # pydantic is typer's own (typer._adapters), not kvbench's workload config.
    code = (f"import sys; sys.argv = ['kvbench', 'compare', {str(BASELINE)!r}, {str(BASELINE)!r},"
            " '--quiet']\nfrom kvbench.cli import main\nmain()")
    assert {n for n in _top(_loaded(code)) if not n.startswith("pydantic")} == set()


def test_the_report_command_loads_no_engine_cache_config_or_torch(tmp_path):
    code = (f"import sys; sys.argv = ['kvbench', 'report', {str(BASELINE)!r}, '--out', "
            f"{str(tmp_path)!r}, '--quiet']\nfrom kvbench.cli import main\nmain()")
    loaded = _top(_loaded(code))
    assert not {n for n in loaded if n.split(".")[0] in ("kvbench", "torch", "yaml")}
    assert (tmp_path / "index.html").exists()


def test_result_schema_describes_every_registered_metric_and_the_baseline():
    schema = result_json_schema()
    props = schema["properties"]["runs"]["items"]["properties"]["metrics"]["properties"]
    assert set(props) == set(METRICS)
    assert all(p["description"] for p in props.values())
    baseline = json.loads(BASELINE.read_text())
    assert set(schema["required"]) <= set(baseline)
    for run in baseline["runs"]:
        assert set(run["metrics"]) <= set(props)
