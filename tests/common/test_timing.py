"""Provenance that every benchmark's results file carries (``slimkv.common.timing``)."""

from __future__ import annotations

import json
import subprocess
import sys

from slimkv.common import timing


def test_machine_info_records_machine_and_provenance(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["slimkv", "eval", "ruler", "--limit", "2"])
    info = timing.machine_info()
    for key in ("platform", "processor", "cpu_count", "torch", "threads", "load_average"):  # the keys other code reads stay
        assert key in info
    assert info["command"] == ["slimkv", "eval", "ruler", "--limit", "2"]
    assert info["packages"]["torch"] == info["torch"]
    assert set(timing.PROVENANCE_PACKAGES) <= set(info["packages"])
    assert info.get("instruction_set") in (None, "AVX-512", "AVX2", "other")
    json.dumps(info)


def test_package_versions_say_none_for_an_absent_package():
    versions = timing.package_versions(("numpy", "no-such-distribution-slimkv"))
    assert versions["numpy"] and versions["no-such-distribution-slimkv"] is None


def test_git_commit_is_none_outside_a_checkout_and_marks_a_dirty_tree(tmp_path):
    assert timing.git_commit(tmp_path) is None
    run = {"cwd": tmp_path, "check": True, "capture_output": True}
    subprocess.run(["git", "init", "-q"], **run)
    (tmp_path / "a.txt").write_text("one\n")
    subprocess.run(["git", "add", "a.txt"], **run)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one"], **run)
    head = subprocess.run(["git", "rev-parse", "HEAD"], text=True, **run).stdout.strip()
    assert timing.git_commit(tmp_path) == head
    (tmp_path / "a.txt").write_text("two\n")
    assert timing.git_commit(tmp_path) == head + "+dirty"


def test_instruction_set_from_cpu_flags(monkeypatch, tmp_path):
    import builtins

    real_open = builtins.open
    for flags, expected in (("fpu avx2 avx512f", "AVX-512"), ("fpu sse avx2", "AVX2"), ("fpu neon", "other")):
        cpuinfo = tmp_path / "cpuinfo"
        cpuinfo.write_text(f"model name\t: Test CPU\nflags\t\t: {flags}\n")
        monkeypatch.setattr(builtins, "open", lambda path, *a, _c=cpuinfo, **k: real_open(_c if path == "/proc/cpuinfo" else path, *a, **k))
        assert timing._cpu_facts() == {"cpu_model": "Test CPU", "instruction_set": expected}
        monkeypatch.setattr(builtins, "open", real_open)


def test_write_results_carries_the_provenance(tmp_path):
    path = timing.write_results("bench", {"rows": [1]}, tmp_path)
    body = json.loads(path.read_text())
    assert body["benchmark"] == "bench" and body["rows"] == [1]
    assert {"git_commit", "command", "packages", "threads", "load_average"} <= set(body["machine"])
