"""``bench/benchutil.py``'s machine line tells CPUs apart that a VM names alike (the figures of docs/benchmarks.md's
table are quoted per machine)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from benchutil import cpu_model  # noqa: E402

BLOCK = ("processor\t: {n}\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: {model}\n"
         "model name\t: AMD EPYC\nflags\t\t: fpu sse2 avx avx2 fma{extra}\n\n")


def test_cpu_model_names_family_model_and_the_widest_vector_extension(tmp_path):
    zen3, zen4 = tmp_path / "zen3", tmp_path / "zen4"
    zen3.write_text(BLOCK.format(n=0, model=1, extra="") + BLOCK.format(n=1, model=1, extra=""))
    zen4.write_text(BLOCK.format(n=0, model=17, extra=" avx512f avx512bw") + BLOCK.format(n=1, model=17, extra=""))
    assert cpu_model(str(zen3)) == "AMD EPYC (family 25 model 1, avx2)"
    assert cpu_model(str(zen4)) == "AMD EPYC (family 25 model 17, avx512f)"  # the first processor's block


def test_cpu_model_without_family_or_flags_is_the_bare_name(tmp_path):
    p = tmp_path / "cpuinfo"
    p.write_text("processor\t: 0\nmodel name\t: Some CPU\n")
    assert cpu_model(str(p)) == "Some CPU"
    assert cpu_model(str(tmp_path / "missing")) not in ("", "Some CPU")  # platform.processor() or "unknown"
