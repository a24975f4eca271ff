"""``stapo-jax plan --target``: a tiny STAPO run (packed updates) compiled by the real TPU compiler (libtpu, a
v5e 2x2 slice) and the real GPU compiler (deviceless, 2 x H100), on this CPU host.

What is asserted: every program of the run compiles; the target's attention kernel is in the compiled programs
(Mosaic ``tpu_custom_call`` for splash on TPU, cuDNN flash attention on NVIDIA); memory and cost figures are
present; the report names the compiler and its version; nothing that builds a program runs eagerly on the
target's devices (the old train / decode planners compile under a TPU mesh, and platform choices read the mesh,
not ``jax.default_backend()``); a config that does not fit exits 1 with the verdict; missing compiler packages
give one error line naming the install command; the pinned compilers match the installed jax.
"""
from __future__ import annotations

import importlib.metadata as md
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stapo_jax.config.schema import load_config
from stapo_jax.tools import plan
from stapo_jax.tools.plan_report import fits_programs, format_programs, phase_memory, predict, slots_that_fit
from stapo_jax.tools.targets import TARGETS, Target, packages_dir, target_environment

REPO = Path(__file__).resolve().parents[2]
TINY = """
model: {preset: null, vocab_size: 512, hidden_size: 256, intermediate_size: 512, num_hidden_layers: 2,
        num_attention_heads: 4, num_key_value_heads: 2, head_dim: 128, max_position_embeddings: 512,
        tie_word_embeddings: false, dtype: bfloat16, param_dtype: float32, remat: none, attention: auto,
        use_remove_padding: true}
tokenizer: {kind: builtin}
data: {max_prompt_length: PROMPT}
rollout: {n: 4, max_new_tokens: NEW, max_concurrent_decodes: 8}
actor: {ppo_mini_batch_size: 4, ppo_micro_batch_size: 2}
trainer: {train_batch_size: 8, eval_every: EVAL}
algorithm: {recipe: stapo}
"""


def tiny_config(tmp_path, prompt=64, new=64, eval_every=1):
    """The tiny run's YAML: prompts of ``prompt`` tokens (prefill buckets 16 .. prompt), ``new`` new tokens (KV
    lengths 32 .. prompt + new)."""
    p = tmp_path / "tiny_target.yaml"
    p.write_text(TINY.replace("PROMPT", str(prompt)).replace("NEW", str(new)).replace("EVAL", str(eval_every)))
    return p


def check_run(result, kernel_prefix: str, compiler_prefix: str, prefill=(16, 32, 64), kv=(32, 64, 128)):
    progs = result["programs"]
    assert not [e for e in progs if "error" in e], [e["error"] for e in progs if "error" in e]
    names = [e["name"] for e in progs]
    # the run's program set: old log-probs + update step per packed geometry, prefill per bucket, decode and
    # insert per KV length, greedy decode for the held-out passes, the weight sync
    assert sum(n.startswith("old log-probs (packed") for n in names) == 2
    assert sum(n.startswith("update step (packed") for n in names) == 2
    assert [n for n in names if n.startswith("prefill")] == [f"prefill 8x{b}" for b in prefill]
    assert [n for n in names if n.startswith("decode step")] == [f"decode step x8, KV {k}" for k in kv]
    assert sum(n.startswith("insert") for n in names) == sum(b <= k for b in prefill for k in kv)
    assert sum(n.startswith("greedy decode") for n in names) == len(kv) and "weight sync, one layer (x L)" in names
    # loop-free units for the predicted step: 1 and 2 unrolled layers of one micro-batch, one decode step
    assert sorted(e["name"] for e in progs if e["phase"] == "unit") == sorted(
        [f"unit: {w}, {n}" for w in ("old log-probs", "update step") for n in ("1 layer", "2 layers")]
        + [f"unit: decode step x1, KV {kv[-1]}"])
    for e in progs:
        assert e["memory"]["peak"] > 0 and e["compile_s"] > 0
        assert e["cost"]["bytes_accessed"] > 0
    for e in progs:  # the attention kernel of the target in every program with uncached attention
        if e["name"].removeprefix("unit: ").startswith(("old log-probs", "update step", "prefill")):
            assert any(k.startswith(kernel_prefix) for k in e["kernels"]), (e["name"], e["kernels"])
        else:
            assert not e["kernels"], e  # decode attends over the KV cache; insert and sync have no attention
    assert result["compiler"].startswith(compiler_prefix), result["compiler"]
    mem = phase_memory(result)
    assert set(mem) == {"update", "rollout", "sync", "eval"}
    assert mem["rollout"]["resident"] == result["resident"]["trainer_state"] > 0
    assert fits_programs(result) is True
    assert slots_that_fit(result) > result["spec"]["decode_slots"]  # a tiny run leaves HBM for many more slots
    p = predict(result)
    assert p["step_s"] > 0 and 0 < p["update_mfu"] <= p["update_hfu"] < 1 and p["decode_tokens_per_s"] > 0
    # MFU counts forward + backward (3 forwards) only; HFU every forward the update runs (pre-pass, remat)
    a, spec = result["analytic"], result["spec"]
    assert p["update_hfu"] / p["update_mfu"] == pytest.approx(
        a["train_flops_per_update"] / (3 * a["forward_flops_per_sequence"] * spec["mini_batch_sequences"]))
    report = format_programs(result)
    assert "FITS" in report and "compiler prediction" in report and result["compiler"] in report


def test_tiny_stapo_run_compiles_for_tpu_v5e_with_splash(tmp_path):
    cfg = load_config(tiny_config(tmp_path))
    spec = plan.make_spec(cfg, mesh="data=1,fsdp=2,tensor=2", target="tpu-v5e-4")
    assert spec["model"]["attention"] == "auto" and spec["model"]["scan_unroll"] == 1
    result = plan.plan(spec, timeout_s=600)
    check_run(result, "tpu_custom_call", "libtpu 0.0.42")
    # TPU predictions come from the compiler's own cost model
    assert all(e["cost"]["optimal_seconds"] > 0 for e in result["programs"] if e["phase"] == "unit")


def test_tiny_stapo_run_compiles_for_two_h100_with_cudnn(tmp_path):
    cfg = load_config(tiny_config(tmp_path, prompt=32, new=32))
    result = plan.plan(plan.make_spec(cfg, mesh="data=1,fsdp=2,tensor=1", target="gpu-2xh100"), timeout_s=600)
    check_run(result, "__cudnn$fmha", "XLA GPU, deviceless", prefill=(16, 32), kv=(32, 64))
    assert result["spec"]["target"]["chip"] == "NVIDIA H100"


NO_EAGER = r"""
import json, sys
import jax
from jax.sharding import AbstractMesh
from models.attention import resolve_implementation
from models.layer_scan import resolve_scan_unroll
from models.platform import mesh_platform
from models.qwen3_config import Qwen3Config
from models.sharding import make_mesh
from stapo_jax.rollout.decode_fns import resolve_kernel_layout
from stapo_jax.tools.plan_programs import plan_decode, plan_train
from stapo_jax.tools.targets import get_target, target_devices

spec = json.loads(sys.argv[1])
mesh = make_mesh(1, 2, 2, devices=target_devices(get_target("tpu-v5e-4")))
qcfg = Qwen3Config(**{k: tuple(v) if isinstance(v, list) else v for k, v in spec["model"].items()})
out = {"default_backend": jax.default_backend(), "mesh": mesh_platform(mesh)}
with jax.set_mesh(mesh):
    out["abstract"] = mesh_platform()
    out["attention"] = resolve_implementation("auto", "bfloat16")
    out["scan_unroll"] = resolve_scan_unroll("auto")
    out["kernel_layout"] = resolve_kernel_layout("auto", jax.sharding.get_abstract_mesh())
out["outside"] = mesh_platform()
out["train_peak"] = plan_train(spec, qcfg, mesh)["memory"]["peak"]
out["decode_peak"] = plan_decode(spec, qcfg, mesh)["memory"]["peak"]
print("RESULT " + json.dumps(out))
"""


def test_nothing_runs_eagerly_on_target_devices_and_choices_read_the_mesh(tmp_path):
    """The planner's train / decode programs compile under a TPU topology mesh (the optimizer-state shardings
    and the PRNG key are built off the mesh), and the platform choices made while tracing follow the mesh's
    devices while the host backend stays CPU."""
    cfg = load_config(tiny_config(tmp_path))
    spec = plan.make_spec(cfg, mesh="data=1,fsdp=2,tensor=2", target="tpu-v5e-4")
    env = target_environment(Target(**spec["target"]), dict(os.environ))
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", NO_EAGER, json.dumps(spec)], env=env, capture_output=True,
                          text=True, timeout=600)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    out = json.loads(line[0][7:])
    assert out["default_backend"] == "cpu" and out["outside"] == "cpu"
    assert (out["mesh"], out["abstract"], out["attention"], out["scan_unroll"], out["kernel_layout"]) == \
        ("tpu", "tpu", "splash", 1, "in_out")
    assert out["train_peak"] > 0 and out["decode_peak"] > 0


def test_config_that_does_not_fit_exits_1_with_the_verdict(tmp_path, capsys):
    rc = plan.main(["--config", str(tiny_config(tmp_path, prompt=16, new=16, eval_every=0)), "--target", "tpu-v5e-4",
                    "--mesh", "data=1,fsdp=2,tensor=2", "--only", "decode", "--hbm-gb", "0.005"])
    out = capsys.readouterr().out
    assert rc == 1, out
    assert "rollout phase per device" in out and "DOES NOT FIT" in out
    assert "rollout.max_concurrent_decodes that fits the rollout phase: at most 0 per engine (configured 8)" in out


def test_missing_target_packages_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("STAPO_JAX_TARGET_PACKAGES", str(tmp_path / "empty"))
    if any(p for p in sys.path if (Path(p) / "libtpu").is_dir()):
        pytest.fail("libtpu is on this interpreter's own path: the target packages must live apart (.venv/targets)")
    rc = plan.main(["--config", str(tiny_config(tmp_path)), "--target", "tpu-v6e-64", "--mesh",
                    "data=1,fsdp=8,tensor=8"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert "libtpu" in err and "make setup-targets" in err


def test_unknown_target_and_mesh_size_mismatch_are_errors(tmp_path, capsys):
    assert plan.main(["--config", str(tiny_config(tmp_path)), "--target", "tpu-v9"]) == 2
    assert "unknown target" in capsys.readouterr().err
    assert plan.main(["--config", str(tiny_config(tmp_path)), "--target", "tpu-v5e-4", "--mesh",
                      "data=1,fsdp=8,tensor=1"]) == 2
    assert "--devices says 4" in capsys.readouterr().err
    assert plan.main(["--config", str(tiny_config(tmp_path)), "--programs", "core"]) == 2
    assert "pass --target too" in capsys.readouterr().err


def test_target_pins_match_the_installed_jax():
    """requirements-targets.txt pins the libtpu that ``jax[tpu]`` asks for and the CUDA plugin of this jax, and
    ``make setup-targets`` installed exactly those into the packages directory."""
    from packaging.requirements import Requirement

    pins = {}
    for line in (REPO / "requirements-targets.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            r = Requirement(line)
            if r.marker is None or r.marker.evaluate():
                pins[r.name] = str(r.specifier).removeprefix("==")
    jax_v = md.version("jax")
    tpu_req = [Requirement(r) for r in md.requires("jax") if "libtpu" in r and 'extra == "tpu"' in r]
    assert tpu_req and tpu_req[0].specifier.contains(pins["libtpu"]), (tpu_req, pins["libtpu"])
    assert pins["jax-cuda12-plugin"] == pins["jax-cuda12-pjrt"] == jax_v
    installed = {d.metadata["Name"].lower(): d.version for d in md.distributions(path=[str(packages_dir())])}
    for name, version in pins.items():
        assert installed.get(name) == version, (name, version, installed.get(name))
    assert set(TARGETS) >= {"tpu-v5p-64", "tpu-v6e-64", "tpu-v5e-256", "tpu-v4-32", "gpu-8xh100", "gpu-8xh200",
                            "gpu-2x8xh100"}


def test_a_compiler_abort_costs_one_program(tmp_path):
    """A compile that aborts the process leaves ``{"start": name}`` without an entry in the journal:
    ``record_crash`` gives that program the abort's message as its error, and the next attempt takes every
    finished entry (and the failure) from the journal instead of compiling them again; prefills compile again
    (their output shardings feed the inserts)."""
    from stapo_jax.tools.plan_run import JOURNAL, compile_program, record_crash

    path = tmp_path / "journal.jsonl"
    done = {"name": "update step (packed 1x128)", "phase": "update", "compile_s": 3.0, "memory": {"peak": 1}}
    pre = {"name": "prefill 8x16", "phase": "rollout", "compile_s": 1.0, "memory": {"peak": 1}}
    lines = [{"start": done["name"], "phase": "update"}, done, {"start": pre["name"], "phase": "rollout"}, pre,
             {"start": "decode step x8, KV 32", "phase": "rollout"}]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    msg = "F1205 lowered_getter.cc:23] Check failed: device_id < kMaxDeviceCount"
    assert record_crash(str(path), msg) == "decode step x8, KV 32"
    assert record_crash(str(path), msg) is None  # nothing in progress any more
    JOURNAL.open(str(path))
    try:
        never = lambda: pytest.fail("a journalled program must not compile again")  # noqa: E731
        entry, compiled = compile_program("decode step x8, KV 32", "rollout", never)
        assert compiled is None and entry["error"] == f"compiler crashed: {msg}"
        assert compile_program(done["name"], "update", never)[0] == done
        assert JOURNAL.reuse(pre["name"]) is None  # compiles again
    finally:
        JOURNAL.open(None)


def test_program_cache_reuses_the_programs_two_recipes_share(tmp_path, capsys):
    """``--program-cache``: GRPO after STAPO takes the old-log-prob, rollout and sync programs (same lowered text)
    from the cache and compiles its own update steps (another loss); STAPO again takes its update programs from
    it. A prefill always compiles (the inserts need its compiled output shardings)."""
    cache, conf = tmp_path / "cache", tiny_config(tmp_path, prompt=32, new=32, eval_every=0)

    def run(tag, *overrides):
        out = tmp_path / f"{tag}.json"
        rc = plan.main(["--config", str(conf), "--mesh", "data=1,fsdp=2,tensor=1", "--target", "gpu-2xh100",
                        "--programs", "core", "--program-cache", str(cache), "--json", str(out), *overrides])
        assert rc == 0
        return {e["name"]: e for e in json.loads(out.read_text())["programs"]}

    first = run("stapo")
    assert not any(e.get("cached") for e in first.values()) and len(list(cache.glob("*.json"))) == len(first) - 1
    grpo = run("grpo", "algorithm.recipe=grpo", "actor.token_mask=none")
    assert grpo.keys() == first.keys()
    for name, e in grpo.items():
        shared = not name.startswith(("prefill", "update step", "unit: update step"))  # the loss is in these only
        assert bool(e.get("cached")) == shared, name
        if shared:
            assert e["memory"] == first[name]["memory"] and e["compile_s"] == first[name]["compile_s"]
    assert not any(grpo[n].get("cached") for n in grpo if n.startswith(("update step", "prefill")))  # prefill: always
    # STAPO's update step holds S2T's correction (a micro-batch redone under a conditional, both branches counted by
    # XLA: twice GRPO's FLOPs); its prediction units are the usual path, no micro-batch redone (GRPO's FLOPs)
    for name in (n for n in first if n.startswith("update step")):
        assert first[name]["cost"]["flops"] > 1.8 * grpo[name]["cost"]["flops"], name
    for name in (n for n in first if n.startswith("unit: update step")):
        assert first[name]["cost"]["flops"] == pytest.approx(grpo[name]["cost"]["flops"], rel=0.02), name
    # bench/paper_targets.py renders a plan's JSON as a row of docs/benchmarks.md's table
    sys.path.insert(0, str(REPO / "bench"))
    import paper_targets

    (tmp_path / "rows").mkdir()
    capsys.readouterr()  # the plans' reports so far
    (tmp_path / "rows" / "tiny-gpu-2xh100-max_concurrent_decodes=8.json").write_text((tmp_path / "grpo.json").read_text())
    paper_targets.main(["--out", str(tmp_path / "rows"), "--table-only", "--pairs",
                        "tiny:gpu-2xh100:rollout.max_concurrent_decodes=8", "absent:gpu-2xh100"])
    rows = capsys.readouterr().out.splitlines()
    assert rows[0].startswith("| config | target |") and "update MFU / HFU" in rows[0]
    cells = [c.strip() for c in rows[2].split("|")[1:-1]]
    assert cells[:2] == ["tiny", "gpu-2xh100"] and cells[4] == "fits" and cells[5].startswith("8 / ")
    mfu, hfu = (float(x.rstrip("%")) for x in cells[8].split(" / "))
    assert 0 < mfu <= hfu < 100
    assert rows[3] == "| absent | gpu-2xh100 | not compiled | | | | | | |"
    again = run("again", "--only", "train")  # STAPO's update programs again: all from the cache
    assert again.keys() == {n for n in first if n.startswith(("old log-probs", "update step", "unit: old", "unit: up"))}
    assert all(e.get("cached") and e["memory"] == first[n]["memory"] for n, e in again.items())


def test_program_cache_needs_a_target(tmp_path, capsys):
    assert plan.main(["--config", str(tiny_config(tmp_path)), "--program-cache", str(tmp_path / "c")]) == 2
    assert "--program-cache" in capsys.readouterr().err
