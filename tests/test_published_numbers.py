"""What the repository publishes matches its data: benchmarks/results/claims.md is what
benchmarks/claims.py renders from the committed JSON (its template, figures and rules in benchmarks/claims_md/),
every results file is referred to by a document, every benchmark script is documented, and no
document points outside the repository."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
RESULTS = BENCHMARKS / "results"
SKIP_DIRS = {".git", ".venv", ".venv-kvpress", ".venv-ruler", "node_modules", "runs", "demo_runs", "slimkv.egg-info", ".pytest_cache", ".ruff_cache"}


def results_files() -> list[Path]:
    """Every results file: at the top of benchmarks/results/ and in its experiment folders (not the
    folders' manifest.json, nor ruler/, which documents its own files)."""
    top = [p for p in RESULTS.iterdir() if p.is_file() and not p.name.startswith(".")]
    folders = [d for d in RESULTS.iterdir() if d.is_dir() and d.name != "ruler"]
    return top + [p for d in folders for p in d.iterdir() if p.is_file() and p.name not in ("manifest.json", "README.md")]


def documents() -> list[Path]:
    """Every Markdown file of the repository (not virtualenvs, run folders or caches)."""
    return sorted(p for p in ROOT.rglob("*.md") if not SKIP_DIRS.intersection(p.relative_to(ROOT).parts[:-1]))


@pytest.fixture(scope="module")
def claims():
    """benchmarks/claims.py as a module, with benchmarks/ on sys.path for its package claims_md/
    (both are gone from sys.modules and sys.path afterwards)."""
    spec = importlib.util.spec_from_file_location("claims_under_test", BENCHMARKS / "claims.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCHMARKS))
        for name in [spec.name, *(n for n in sys.modules if n == "claims_md" or n.startswith("claims_md."))]:
            sys.modules.pop(name, None)


@pytest.fixture(scope="module")
def rules(claims):
    """benchmarks/claims_md/rules.py: the verdict rules."""
    return importlib.import_module("claims_md.rules")


@pytest.fixture(scope="module")
def results_file(claims):
    """``load``: a JSON file of benchmarks/results/ as claims.md reads it."""
    return importlib.import_module("claims_md.figures").load


def test_claims_md_is_what_the_script_renders_from_the_committed_json(claims):
    committed = (RESULTS / "claims.md").read_text(encoding="utf-8")
    assert committed == claims.render(), "benchmarks/results/claims.md differs from its JSON: run .venv/bin/python benchmarks/claims.py"


def test_the_check_option_reports_a_difference(claims, tmp_path, monkeypatch):
    lines = []
    assert claims.main(["--check"], out=lines.append) == 0
    stale = tmp_path / "claims.md"
    stale.write_text(claims.render().replace("supported", "proven", 1), encoding="utf-8")
    monkeypatch.setattr(claims, "OUTPUT", stale)
    assert claims.main(["--check"], out=lines.append) == 1
    assert "proven" in lines[-2] and "differs" in lines[-1]


def test_the_template_fills_fields_lists_and_tables(claims):
    fields = {"rows": [{"name": "a", "x": 1.5, "ok": True}, {"name": "b", "x": None, "ok": False}], "names": ["a", "b", "c"], "sign": -1}
    template = "{names:and:code}: {sign:lower/level/higher}, {sign:claim}\n| name | x | ok |\n|-\n@rows | {name} | {x:.1f} | {ok:yes/no} |"
    assert claims.fill(template, fields) == ["`a`, `b` and `c`: lower, not supported", "| name | x | ok |", "| --- | ---: | --- |",
                                             "| a | 1.5 | yes |", "| b | - | no |"]


def test_the_rules_decide_as_documented(rules):
    def stat(values):
        mean = sum(values) / len(values)
        std = (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5
        return {"mean": mean, "std": std, "min": min(values), "max": max(values), "n": len(values)}

    assert rules.seed_verdict(stat([0.9, 0.91, 0.92]), stat([0.5, 0.52, 0.51])) == 1
    assert rules.seed_verdict(stat([0.5, 0.52, 0.51]), stat([0.9, 0.91, 0.92])) == -1
    assert rules.seed_verdict(stat([0.5, 0.95, 0.9]), stat([0.6, 0.62, 0.61])) == 0  # ranges overlap
    assert rules.seed_verdict(stat([0.9, 0.91]), stat([0.5, 0.52])) == 0  # two seeds never support a claim
    assert rules.ppl_verdict({"a": 80.0, "b": 40.0}, {"a": 100.0, "b": 50.0}) == -1
    assert rules.ppl_verdict({"a": 80.0, "b": 48.0}, {"a": 100.0, "b": 50.0}) == 0  # inside the margin on one text
    assert rules.ppl_verdict({"a": 120.0, "b": 60.0}, {"a": 100.0, "b": 50.0}) == 1


def test_claims_md_quotes_the_figures_the_json_holds(results_file):
    """A few figures read straight from the JSON, so a wrong reading cannot hide behind a self-consistent render."""
    text = (RESULTS / "claims.md").read_text(encoding="utf-8")
    decode = results_file("decode_all_1thread.json")
    fixed = next(t for t in decode["targets"] if t["label"] == "kvm-fixed")
    assert f"{fixed['value']:.1f}x" in text
    sweep = results_file("compress_sweep_smollm2.json")
    for row in sweep["rows"]:
        if row["method"] in ("rootcov", "latentllm") and row["ratio"] == 0.4:
            assert f"{row['ppl_by_text']['shakespeare-val']:.2f}" in text
    recall = results_file("recall_frontier.json")
    rank2 = next(a for a in recall["aggregate"] if a["label"] == "lrkv:rank=2")
    assert f"{rank2['lengths']['1x']['accuracy']['mean']:.3f}" in text


def test_no_document_points_outside_the_repository():
    for doc in documents():
        text = doc.read_text(encoding="utf-8")
        assert "../shared" not in text and "/work/shared" not in text, f"{doc.relative_to(ROOT)} points outside the repository"


def test_relative_links_of_the_documents_resolve():
    link = re.compile(r"\]\(([^)\s]+)\)")
    for doc in documents():
        for target in link.findall(doc.read_text(encoding="utf-8")):
            if re.match(r"^[a-z]+:", target) or target.startswith("#"):
                continue
            path = (doc.parent / target.split("#")[0]).resolve()
            assert path.exists(), f"{doc.relative_to(ROOT)} links to {target}, which does not exist"


def test_every_results_file_is_referred_to_by_a_document():
    """A results file is referred to when a Markdown file outside its own family (``x.json``,
    ``x.md``, ``x.png``) names it, or names its stem with one of those extensions (a link to
    ``x.md`` covers the ``x.json`` it was rendered from and the ``x.png`` beside it)."""
    texts = {doc: doc.read_text(encoding="utf-8") for doc in documents()}
    unreferenced = []
    for path in sorted(results_files()):
        named = re.compile(rf"(?<![\w.]){re.escape(path.stem)}\.(json|md|png)\b")
        if not any(named.search(text) for doc, text in texts.items() if not (doc.parent == path.parent and doc.stem == path.stem)):
            unreferenced.append(path.name)
    assert not unreferenced, f"no document refers to these results files (refer to them or delete them): {unreferenced}"


def test_every_benchmark_script_is_documented():
    """Each script in benchmarks/ is named in the README, in docs/ or in the Makefile (its make target)."""
    texts = [(ROOT / "README.md").read_text(encoding="utf-8"), (ROOT / "Makefile").read_text(encoding="utf-8")]
    texts += [doc.read_text(encoding="utf-8") for doc in sorted((ROOT / "docs").glob("*.md"))]
    missing = [p.name for p in sorted(BENCHMARKS.glob("*.py")) if not any(p.name in text for text in texts)]
    assert not missing, f"benchmark scripts no document names (document them or delete them): {missing}"


@pytest.mark.parametrize("name", sorted(p.stem for p in (RESULTS / "niah").glob("niah_*smollm2.json")))
def test_every_retrieval_comparison_is_what_its_json_renders(name):
    from slimkv.common.files import read_json
    from slimkv.retrieval.comparison import render_markdown

    committed = (RESULTS / "niah" / f"{name}.md").read_text(encoding="utf-8")
    assert committed == render_markdown(read_json(RESULTS / "niah" / f"{name}.json", expect=dict)), \
        f"benchmarks/results/niah/{name}.md differs from its JSON: run benchmarks/niah_smollm2.py report"


def test_each_experiment_folder_has_the_manifest_of_its_files():
    """benchmarks/results/ holds one folder per experiment, each file in the folder its name calls for,
    and each folder's manifest.json lists exactly its files with their writer, and a folder of runs
    (ruler/) its runs with theirs (``results_manifest.py``)."""
    spec = importlib.util.spec_from_file_location("results_manifest_under_test", BENCHMARKS / "results_manifest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.problems() == [], "run .venv/bin/python benchmarks/results_manifest.py"
    for folder in module.folders():
        recorded, regenerated = json.loads((folder / "manifest.json").read_text(encoding="utf-8")), module.manifest(folder, history=False)
        assert [f["written_by"] for f in recorded["files"]] == [f["written_by"] for f in regenerated["files"]]
        assert [r["written_by"] for r in recorded.get("runs", [])] == [r["written_by"] for r in regenerated.get("runs", [])]
