"""py-cpuinfo's answer kept per processor (helpers.core.cpu_info): asked once, read by every later process."""

import json
import sys
import types

import pytest

from helpers.core import cpu_info

X86 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9B14
flags\t\t: fpu sse2 avx2 avx512f

processor\t: 1
model name\t: AMD EPYC 9B14
flags\t\t: fpu sse2 avx2 avx512f
"""
ANSWER = {"arch": "X86_64", "flags": ["avx2", "avx512f", "fpu", "sse2"], "vendor_id_raw": "AuthenticAMD",
          "hz_actual_friendly": "2.6000 GHz", "count": 2}


def test_processor_key_names_the_processor_by_model_and_flags():
    key = cpu_info.processor_key(X86, "x86_64")
    assert key and len(key) == 16
    assert cpu_info.processor_key(X86.replace(" avx512f", ""), "x86_64") != key  # another feature set
    assert cpu_info.processor_key(X86.replace("9B14", "7763"), "x86_64") != key  # another model
    assert cpu_info.processor_key(X86, "aarch64") != key
    # only the first processor's block counts: a later block's flags change nothing
    assert cpu_info.processor_key(X86 + "flags\t: sve\n", "x86_64") == key
    arm = "processor\t: 0\nFeatures\t: fp asimd sve\nCPU implementer\t: 0x41\n"
    assert cpu_info.processor_key(arm, "aarch64") is not None
    assert cpu_info.processor_key("processor\t: 0\n", "x86_64") is None  # no flags listed: no name


def test_cache_file_lives_in_the_given_folder_and_is_named_after_this_processor(tmp_path):
    path = cpu_info.cache_file(tmp_path)
    if path is None:  # no /proc/cpuinfo (not Linux)
        pytest.skip("no /proc/cpuinfo here")
    assert path.parent == tmp_path and path.name.startswith("cpu-info-") and path.suffix == ".json"


def test_cached_asks_once_keeps_what_deepspeed_reads_and_later_processes_read_the_file(tmp_path):
    path = tmp_path / "ops" / "cpu-info-x.json"
    calls = []

    def ask():
        calls.append(1)
        return dict(ANSWER)

    first = cpu_info.cached(ask, path)
    assert first() == {k: ANSWER[k] for k in cpu_info.KEYS}
    assert first() == first() and len(calls) == 1  # asked once in this process
    assert json.loads(path.read_text()) == {k: ANSWER[k] for k in cpu_info.KEYS}

    def never():
        raise AssertionError("a later process must read the file, not ask py-cpuinfo")

    later = cpu_info.cached(never, path)  # another rank, another launch
    assert later()["flags"] == ANSWER["flags"] and later()["vendor_id_raw"] == "AuthenticAMD"
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no partial file left behind


def test_cached_keeps_the_answer_in_memory_where_the_folder_cannot_be_written(tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    calls = []
    get = cpu_info.cached(lambda: calls.append(1) or dict(ANSWER), blocker / "cpu-info-x.json")
    assert get()["arch"] == "X86_64" and get()["arch"] == "X86_64"
    assert len(calls) == 1


def test_remember_replaces_get_cpu_info_once(tmp_path, monkeypatch):
    if cpu_info.cache_file(tmp_path) is None:
        pytest.skip("no /proc/cpuinfo here")
    calls = []
    fake = types.ModuleType("cpuinfo")
    fake.get_cpu_info = lambda: calls.append(1) or dict(ANSWER)
    monkeypatch.setitem(sys.modules, "cpuinfo", fake)
    assert cpu_info.remember(tmp_path) and cpu_info.remember(tmp_path)
    patched = fake.get_cpu_info
    assert patched.__wrapped__.__name__ == "<lambda>"  # wrapped once, not a wrapper of a wrapper
    from cpuinfo import get_cpu_info  # as DeepSpeed's op builders import it

    assert get_cpu_info()["arch"] == "X86_64" and get_cpu_info()["arch"] == "X86_64"
    assert len(calls) == 1


def test_remember_does_nothing_without_py_cpuinfo(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "cpuinfo", None)  # `import cpuinfo` raises ImportError
    assert cpu_info.remember(tmp_path) is False
