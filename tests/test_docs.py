"""docs/ stays true to the code: the generated pages match what the models and the metric
registry say, architecture.md names every package and only modules that exist, and no link
in README.md or docs/ leaves the repository."""

import importlib.util
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


def test_no_link_leaves_the_repository():
    for page in [ROOT / "README.md", *DOCS.glob("*.md")]:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"https?://", target) or target.startswith("#"):
                continue
            resolved = (page.parent / target.split("#")[0]).resolve()
            assert resolved.is_relative_to(ROOT) and resolved.exists(), (page.name, target)
