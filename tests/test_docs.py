"""docs/ stays true to the code: the generated pages match what the models and the metric
registry say, architecture.md names every package and only modules that exist, and no link
in README.md or docs/ leaves the repository."""

import importlib.util
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def _gen_docs():
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts" / "gen_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_pages_are_current():
    gen = _gen_docs()
    for name, build in gen.PAGES.items():
        assert (DOCS / name).read_text() == build(), (
            f"docs/{name} is stale: run python scripts/gen_docs.py")


def test_workloads_page_lists_every_key_of_the_schema():
    from kvbench.config import workload_json_schema

    text = (DOCS / "workloads.md").read_text()
    schema = workload_json_schema()
    for model in [schema, *schema["$defs"].values()]:
        for key in model.get("properties", {}):
            assert f"{key}`" in text, key


def test_architecture_names_every_package_and_only_real_modules():
    text = (DOCS / "architecture.md").read_text()
    packages = {p.name for p in (ROOT / "kvbench").iterdir()
                if p.is_dir() and (p / "__init__.py").exists()}
    for package in packages:
        assert f"kvbench/{package}/" in text, package
    for path in re.findall(r"`(kvbench/[\w/]+\.py)`", text):
        assert (ROOT / path).exists(), path
    for module in re.findall(r"`(\w+\.py)`", text):
        assert list((ROOT / "kvbench").rglob(module)) or (ROOT / "scripts" / module).exists() \
            or list((ROOT / "tests").glob(module)), module


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def test_no_link_leaves_the_repository():
    """README.md and docs/ stand alone: every link is a file of the repository (and a heading
    of it when it names one); no link to a web page, but a local server's address."""
    for page in [ROOT / "README.md", *DOCS.glob("*.md")]:
        text = page.read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", text) + re.findall(r"<(\w+://[^>]+)>", text):
            if re.match(r"\w+://(127\.0\.0\.1|localhost)[:/]", target):
                continue
            assert not re.match(r"\w+:", target), (page.name, target)
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            assert resolved.is_relative_to(ROOT) and resolved.exists(), (page.name, target)
            if anchor and resolved.suffix == ".md":
                assert anchor in _anchors(resolved), (page.name, target)


def _documented_fields(result: dict) -> set[str]:
    """Every field name of a result besides metrics and config, and each timeline's `x`."""
    names = {k for k in result if k != "runs"}
    names |= set(result["workload"]) | set(result["environment"])
    for entry in result.get("workloads", []):
        names |= set(entry)
    for run in result["runs"]:
        names |= set(run)
        timeline = run["timeline"]
        names |= set(timeline) | set(timeline["columns"]) | {timeline["x"]}
    return names


def test_results_page_names_every_field_of_a_result(tmp_path, capsys):
    """docs/results.md describes what a run writes besides the metrics (the registry's): the
    envelope, the environment, a run's keys and the timeline's columns in both modes."""
    from cli_helpers import run_cli

    text = (DOCS / "results.md").read_text()
    seen = set()
    for workload, sets in [("reuse-multi-turn.yaml", ["requests.synthetic.num_requests=20"]),
                           ("serve-delay-batching.yaml",
                            ["requests.synthetic.num_requests=20"])]:
        out = tmp_path / f"{workload}.json"
        args = ["run", ROOT / "workloads" / "ci" / workload, "--quiet", "--json", out]
        for item in sets:
            args += ["--set", item]
        code, _, err = run_cli(args, capsys)
        assert code == 0, err
        seen |= _documented_fields(json.loads(out.read_text()))
    missing = sorted(name for name in seen if f"`{name}`" not in text and f'"{name}"' not in text)
    assert not missing, f"docs/results.md does not name these result fields: {missing}"


def _commands(group, path=()):
    """(('trace', 'stats'), click command) for every command of the CLI."""
    for name, command in group.commands.items():
        if hasattr(command, "commands"):
            yield from _commands(command, (*path, name))
        else:
            yield (*path, name), command


def _cli_page() -> dict[tuple, dict[str, str]]:
    """docs/cli.md: per command, each option name -> the default column of its row."""
    page: dict[tuple, dict[str, str]] = {}
    rows: dict[str, str] = {}
    for line in (DOCS / "cli.md").read_text().replace("\\|", "/").splitlines():
        heading = re.match(r"## `kvbench((?: [a-z]+)*)", line)
        if heading:
            rows = page.setdefault(tuple(w for w in heading[1].split() if w.islower()), {})
        row = re.match(r"\|( *`-[^|]*)\|[^|]*\|([^|]*)\|", line)
        if row:
            for name in re.findall(r"`(-[-\w]+)`", row[1]):
                rows[name] = row[2].strip()
    return page


def test_cli_page_lists_every_command_and_option_with_its_default():
    """docs/cli.md has a section per command, a row per option (no more, no fewer), and the
    default column shows the option's default where it has one."""
    import typer.main

    from kvbench.cli import app

    group = typer.main.get_command(app)
    page = _cli_page()
    expected = {(): [p for p in group.params if p.opts != ["--help"]]}
    for path, command in _commands(group):
        expected[path] = [p for p in command.params if p.opts[0].startswith("-")]
    assert set(page) == set(expected), "docs/cli.md: commands differ from the CLI's"
    for path, params in expected.items():
        names = {o for p in params for o in p.opts if o != "--help"}
        assert set(page[path]) == names, (path, set(page[path]) ^ names)
        for p in params:
            shown = re.findall(r"`([^`]+)`", page[path][p.opts[0]])
            if p.default in (None, False) or p.is_flag:
                assert not shown, (path, p.opts[0], "no default to show")
            elif isinstance(p.default, (int, float)):
                assert shown and float(shown[0]) == p.default, (path, p.opts[0], p.default)
            else:
                assert shown and shown[0] == str(p.default), (path, p.opts[0], p.default)


def test_cli_page_names_every_field_of_trace_stats_json(tmp_path):
    """`kvbench trace stats --json` writes `trace_stats`: docs/cli.md names each of its keys."""
    from kvbench.traffic import open_trace, trace_stats

    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 600, "output_length": 5, '
                     '"hash_ids": [0, 1]}\n')
    reader = open_trace(trace)
    stats = trace_stats(list(reader), reader=reader)
    row = next(line for line in (ROOT / "docs" / "cli.md").read_text().splitlines()
               if line.startswith("| `--json` | FILE | | Write the statistics"))
    missing = [k for k in stats if f"`{k}`" not in row]
    assert not missing, f"docs/cli.md: trace stats --json fields not named: {missing}"
