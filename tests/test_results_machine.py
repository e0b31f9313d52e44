"""`machine` in result records names the CPU precisely: model name, family and model numbers, cores."""

from hf_zformer.training import results

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC
stepping\t: 1

processor\t: 1
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC
"""


def test_machine_names_model_family_and_cores(tmp_path, monkeypatch):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(CPUINFO)
    monkeypatch.setattr(results.os, "cpu_count", lambda: 2)
    assert results.machine(cpuinfo).startswith("AMD EPYC (family 25 model 17), 2 cores")


def test_machine_without_cpuinfo(tmp_path, monkeypatch):
    monkeypatch.setattr(results.os, "cpu_count", lambda: 1)
    monkeypatch.setattr(results.platform, "processor", lambda: "arm")
    assert results.machine(tmp_path / "missing").startswith("arm, 1 core")
