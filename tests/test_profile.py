"""Hardware profiles and the calibrated clock, on any machine: the YAML round trip, bad
profiles, interpolation, the clock's closed decode runs against step-by-step sums, and serve
runs priced by a profile."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import run_cli

from kvbench.config import load_workload
from kvbench.engine.clock import ProfileClock, interp1, interp2
from kvbench.engine.scheduler import Scheduler
from kvbench.engine.serve import run_serve
from kvbench.profile import HardwareProfile, Table1D, Table2D, load_profile, model_shape
from kvbench.plan import cache_spec
from kvbench.runner import _load
from kvbench.cache.manager import KVCacheManager

ROOT = Path(__file__).resolve().parents[1]
CHAT = ROOT / "workloads" / "chat-serve.yaml"
SMALL = ["--set", "requests.synthetic.num_requests=60"]


def profile_for(wl, floor: float = 0.05) -> HardwareProfile:
    """A made-up card with simple laws, so that expected times can be computed by hand:
    linear 3 ms + 0.02 ms/token, writes 0.01 + 1e-5 ms/token, prefill 0.1 ms + c (c + s)
    * 1e-7 ms, decode 0.05 ms + n ctx * 1e-5 ms."""
    tokens = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096, 8192)
    chunks, cached = (16, 256, 1024, 4096), (0, 1024, 8192)
    batch, ctx = (1, 8, 64), (64, 1024, 16384)
    return HardwareProfile(
        device="Test GPU", shape=model_shape(wl.model, wl.cache.tokens_per_block),
        measured={"gpu": "Test GPU", "driver": "0"}, hbm_bytes_per_s=3e12,
        h2d_bytes_per_s=50e9, d2h_bytes_per_s=50e9, step_floor_ms=floor,
        graph_tokens=(1, 2, 4, 8, 16, 32, 64, 128),
        linear=Table1D(tokens, tuple(3 + 0.02 * t for t in tokens)),
        kv_write=Table1D((1, 8192), (0.01 + 1e-5, 0.01 + 1e-5 * 8192)),
        prefill=Table2D(chunks, cached, tuple(tuple(0.1 + c * (c + s) * 1e-7 for s in cached)
                                              for c in chunks)),
        decode=Table2D(batch, ctx, tuple(tuple(0.05 + n * x * 1e-5 for x in ctx)
                                         for n in batch)),
    )


@pytest.fixture
def chat():
    return load_workload(CHAT, SMALL[1:])


def write_profile(tmp_path, profile: HardwareProfile) -> Path:
    path = tmp_path / "profile.yaml"
    path.write_text(profile.to_yaml())
    return path


def test_yaml_round_trip(tmp_path, chat):
    profile = profile_for(chat)
    assert load_profile(write_profile(tmp_path, profile)) == profile


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.pop("decode_attention"), "decode_attention.batch: expected a list (missing)"),
    (lambda d: d["linear"].update(ms=[1.0]), "linear.ms: expected 12 values, one per tokens"),
    (lambda d: d["linear"].update(tokens=[2, 1] + d["linear"]["tokens"][2:]),
     "linear.tokens: expected strictly increasing values"),
    (lambda d: d["bandwidth"].update(hbm_bytes_per_s=0), "bandwidth.hbm_bytes_per_s: expected a "
                                                         "positive number"),
    (lambda d: d["prefill_attention"]["ms"].pop(), "prefill_attention.ms: expected 4 rows"),
    (lambda d: d.update(kvbench_profile=2), "kvbench_profile: expected 1"),
    (lambda d: d.pop("kvbench_profile"), "kvbench_profile: expected an integer (missing)"),
])
def test_bad_profiles_are_one_line_input_errors(tmp_path, chat, capsys, edit, message):
    import yaml

    doc = yaml.safe_load(profile_for(chat).to_yaml())
    edit(doc)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(doc))
    code, _, err = run_cli(["run", CHAT, *SMALL, "--set", f"hardware.profile={path}"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert f"{path}: {message}" in err


def test_profile_of_another_shape_is_refused(tmp_path, chat, capsys):
    path = write_profile(tmp_path, profile_for(chat))
    code, _, err = run_cli(["run", CHAT, *SMALL, "--set", f"hardware.profile={path}",
                            "--set", "model.num_layers=16"], capsys)
    assert code == 2 and "num_layers 16 (profile: 32)" in err and "kvbench calibrate" in err


def test_calibrate_without_a_workload_measures_the_default_shape(capsys):
    """`kvbench calibrate` alone (as DESIGN.md pins it) takes every key's default, --set
    applied; without CUDA it refuses in one line, as with a workload."""
    from kvbench.config import Workload, default_workload

    wl = default_workload(["model.num_layers=16"])
    assert wl.name == "default" and wl.model.num_layers == 16
    assert wl.model.model_dump() == {**Workload(name="x").model.model_dump(), "num_layers": 16}
    code, _, err = run_cli(["calibrate", "--set", "model.num_layers=0"], capsys)
    assert code == 2 and err.strip() == (
        "kvbench: error: --set model.num_layers: expected a value > 0 (got 0)")
    pytest.importorskip("torch")
    import torch

    if not torch.cuda.is_available():
        code, _, err = run_cli(["calibrate"], capsys)
        assert code == 2 and err.strip() == (
            "kvbench: error: kvbench calibrate needs a CUDA GPU and torch sees none; a profile "
            "measured elsewhere works here through hardware.profile")


def test_calibrate_takes_a_batch_size_set_on_a_cache_mode_workload(capsys, monkeypatch):
    """calibrate measures scheduler.max_batch_size whatever run.mode says, so a --set of it is
    not refused as 'the scheduler is not used in run.mode: cache' (the defaults are cache
    mode); other scheduler keys still are."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # stop before measuring
    no_gpu = ("kvbench: error: kvbench calibrate needs a CUDA GPU and torch sees none; a "
              "profile measured elsewhere works here through hardware.profile")
    for workload in ([], [str(ROOT / "workloads" / "mooncake-conversation.yaml")]):
        code, _, err = run_cli(["calibrate", *workload, "--set", "scheduler.max_batch_size=64"],
                               capsys)
        assert (code, err.strip()) == (2, no_gpu), workload
    code, _, err = run_cli(["calibrate", "--set", "scheduler.max_num_tokens=64"], capsys)
    assert code == 2 and err.strip() == (
        "kvbench: error: --set scheduler.max_num_tokens=64: the scheduler is not used in "
        "run.mode: cache (it runs in serve mode)")

def test_interpolation_between_and_past_the_points(chat):
    p = profile_for(chat)
    assert interp1(p.linear, 128) == pytest.approx(3 + 0.02 * 128)
    assert interp1(p.linear, 2048) == pytest.approx(3 + 0.02 * 2048)  # linear law: exact
    assert interp1(p.linear, 16384) == pytest.approx(3 + 0.02 * 16384)  # past the last
    assert interp1(p.linear, 0.5) == pytest.approx(3 + 0.02)  # flat before the first
    # Decode is bilinear in (batch, context): exact on the grid, bilinear between.
    assert interp2(p.decode, 8, 1024) == pytest.approx(0.05 + 8 * 1024 * 1e-5)
    n, x = 36, 8704  # midpoints of both axes
    corners = [0.05 + a * b * 1e-5 for a in (8, 64) for b in (1024, 16384)]
    assert interp2(p.decode, n, x) == pytest.approx(sum(corners) / 4)
    got = interp2(p.decode, 8, np.array([64.0, 1024.0, 32768.0]))
    assert got == pytest.approx([0.05 + 8 * 64e-5, 0.05 + 8 * 1024e-5, 0.05 + 8 * 32768e-5])


def test_step_prices_each_kind_of_work(chat):
    clock = ProfileClock(profile_for(chat))
    # One decode batch of 3 (a 4-token graph) at mean context 1000, no copies.
    t = clock.step_seconds(3, 3000, 3000, decodes=3, decode_kv=3000) * 1e3
    decode = float(interp2(clock.profile.decode, 3, 1000))
    assert t == pytest.approx(0.05 + (3 + 0.02 * 4) + 0.01 + 1e-5 * 3 + decode)
    # Two chunks and a decoder: one prefill call (its floor once), eager linear layers.
    chunks = [(256, 0), (1024, 1024)]
    t2 = clock.step_seconds(1281, 0, 0, chunks=chunks, decodes=1, decode_kv=500) * 1e3
    p = [0.1 + c * (c + s) * 1e-7 for c, s in chunks]
    want = (0.05 + 3 + 0.02 * 1281 + 0.01 + 1e-5 * 1281 + 0.1 + sum(x - 0.1 for x in p)
            + float(interp2(clock.profile.decode, 1, 500)))
    assert t2 == pytest.approx(want)
    # Host copies overlap the linear layers: only the excess shows.
    assert clock.step_seconds(1, 0, 0, 1_000_000, decodes=1, decode_kv=10) == pytest.approx(
        clock.step_seconds(1, 0, 0, decodes=1, decode_kv=10))
    big = 10 * 50e9 * 3.02e-3  # ten times what the linear layers of one token take
    slow = clock.step_seconds(1, 0, 0, int(big), decodes=1, decode_kv=10)
    assert slow > clock.step_seconds(1, 0, 0, decodes=1, decode_kv=10) + 0.02


def test_decode_runs_equal_step_by_step_sums(chat):
    clock = ProfileClock(profile_for(chat))
    n, kv = 5, 12_345
    steps = [clock.step_seconds(n, 0, 0, decodes=n, decode_kv=kv + j * n) for j in range(40)]
    assert clock.decode_run_seconds(n, kv, 40) == pytest.approx(sum(steps), rel=1e-12)
    starts = np.concatenate([[0.0], np.cumsum(steps)])
    for gap in (1e-6, steps[0], sum(steps[:7]) + 1e-9, 10.0):
        assert clock.decode_steps_before(n, kv, gap, 40) == int((starts[:40] < gap).sum())
    assert clock.decode_steps_before(n, kv, 0.0, 40) == 0


def test_serve_loop_jumps_equal_single_steps(chat):
    clock = ProfileClock(profile_for(chat))
    requests = _load(chat)
    spec = cache_spec(chat)
    results = []
    for bulk in (True, False):
        r = run_serve(requests, KVCacheManager(spec), Scheduler(chat.scheduler, spec.tokens_per_block),
                      clock, bulk_decode=bulk)
        results.append(r)
    a, b = results
    assert a.iterations == b.iterations
    assert a.duration_s == pytest.approx(b.duration_s, rel=1e-9)
    for x, y in zip(a.requests, b.requests):
        assert x.first_token_s == pytest.approx(y.first_token_s, rel=1e-9, abs=1e-12)


def test_serve_run_with_profile(tmp_path, chat, capsys):
    slow = write_profile(tmp_path, profile_for(chat, floor=5.0))
    out = tmp_path / "r.json"
    code, _, err = run_cli(["run", CHAT, *SMALL, "--set", f"hardware.profile={slow}", "--json",
                            out, "-q"], capsys)
    assert code == 0, err
    m = json.loads(out.read_text())["runs"][0]["metrics"]
    assert m["time_source"] == "modeled"
    # Every step pays the 5 ms floor: TPOT at least that.
    assert m["tpot_ms"]["p50"] >= 5.0
    code, _, _ = run_cli(["run", CHAT, *SMALL, "--json", out, "-q"], capsys)
    preset = json.loads(out.read_text())["runs"][0]["metrics"]
    assert preset["tpot_ms"]["p50"] != m["tpot_ms"]["p50"]


def test_shipped_profiles_load_and_match_the_serve_workload():
    shipped = sorted((ROOT / "profiles").glob("*.yaml"))
    assert shipped, "the repository ships profiles measured on real cards"
    wl = load_workload(ROOT / "workloads" / "mooncake-conversation-serve.yaml")
    for path in shipped:
        p = load_profile(path)
        p.check_shape(model_shape(wl.model, wl.cache.tokens_per_block), str(path))
        assert p.measured["gpu"] and p.measured["driver"] and p.measured["flashinfer"]
        # Measured tables grow with the work.
        assert p.linear.ms[-1] > p.linear.ms[0] and p.decode.ms[-1][-1] > p.decode.ms[0][0]


def test_host_link_metric_uses_the_profile_link(tmp_path, chat, capsys):
    # One figure for the clock's copy time and the metric: with a profile both use its
    # measured pinned bandwidths (50 GB/s each way here), not the preset's PCIe link.
    path = write_profile(tmp_path, profile_for(chat))
    out = tmp_path / "r.json"
    tight = [*SMALL, "--set", "cache.host_offload_ratio=2", "--set", "cache.max_tokens=4096"]
    code, _, err = run_cli(["run", CHAT, *tight, "--set", f"hardware.profile={path}",
                            "--json", out, "-q"], capsys)
    assert code == 0, err
    m = json.loads(out.read_text())["runs"][0]["metrics"]
    moved = m["onboard_bytes"] + m["offload_bytes"]
    assert moved > 0
    assert m["host_link_ms_modeled"] == pytest.approx(moved * 2e3 / 100e9, rel=1e-12)
    code, _, _ = run_cli(["run", CHAT, *tight, "--json", out, "-q"], capsys)
    preset = json.loads(out.read_text())["runs"][0]["metrics"]
    assert preset["host_link_ms_modeled"] != pytest.approx(m["host_link_ms_modeled"], rel=1e-3)


def test_calibrate_timer_queues_each_call_behind_a_spin(monkeypatch):
    """Every timed call runs flush, spin, start event, the call, end event, in this order on
    the stream, so the host's launch latency falls inside the spin, not the timed span; the
    spin lasts SPIN_MS, scaled from a timed probe spin."""
    from kvbench import calibrate

    log: list = []
    made = []

    class Event:
        """Made in pairs, start then end."""

        def __init__(self, enable_timing=False):
            self.name = ("start", "end")[len(made) % 2]
            made.append(self)

        def record(self):
            log.append(self.name)

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return 0.25  # ms: the probe spin and every timed call

    class Flush:
        def zero_(self):
            log.append("flush")

    monkeypatch.setattr(calibrate.torch.cuda, "Event", Event)
    monkeypatch.setattr(calibrate.torch.cuda, "_sleep", lambda cycles: log.append(cycles))
    monkeypatch.setattr(calibrate.torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(calibrate, "FLUSH_BYTES", 8)
    timer = calibrate.Timer(calibrate.torch.device("cpu"))
    assert timer.spin_cycles == int(calibrate.SPIN_PROBE_CYCLES * calibrate.SPIN_MS / 0.25)
    timer.flush = Flush()
    log.clear()
    assert timer(lambda: log.append("call"), min_calls=3, budget_ms=0) == 0.25
    assert log == ["call"] + ["flush", timer.spin_cycles, "start", "call", "end"] * 3
    log.clear()
    timer(lambda: log.append("call"), min_calls=2, budget_ms=0, flush=False)
    assert log == ["call"] + [timer.spin_cycles, "start", "call", "end"] * 2
