"""Every shipped config parses and validates; the paper configs carry the paper's setup (stapo_spec §4, §5, §7)
with the model numbers of the shipped Qwen3 config.json files; mesh presets split the paper's mini-batch; the launch
scripts are valid shell and build the commands they document (DRY_RUN); the DAPO-Math converter works."""
import base64
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from stapo_jax.assets import qwen3_config_dir
from stapo_jax.config.schema import load_config
from stapo_jax.core.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
SHARED_CONFIGS = qwen3_config_dir()
PAPER = sorted((REPO / "configs" / "paper").glob("*.yaml"))
MESHES = sorted((REPO / "configs" / "mesh").glob("*.yaml"))
SIZES = {"1.7b": "Qwen3-1.7B-Base", "8b": "Qwen3-8B-Base", "14b": "Qwen3-14B-Base"}


def test_every_shipped_config_loads():
    files = sorted((REPO / "configs").rglob("*.yaml"))
    assert len(PAPER) == 12 and len(MESHES) >= 4 and len(files) >= 16
    for f in files:
        load_config(f)  # parses, type-checks, cross-field and recipe checks


@pytest.mark.parametrize("path", PAPER, ids=lambda p: p.stem)
def test_paper_config_matches_the_paper(path):
    size, recipe = re.fullmatch(r"qwen3-(1\.7b|8b|14b)-base-(grpo|entropy20|justrl|stapo)", path.stem).groups()
    cfg = load_config(path)
    hf = json.loads((SHARED_CONFIGS / f"{SIZES[size]}.json").read_text())
    assert cfg.model.path == f"Qwen/{SIZES[size]}" and cfg.algorithm.recipe == recipe
    from stapo_jax.tools.plan import plan_model_config
    q = plan_model_config(cfg)  # resolves the hub id by preset name, no download
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "tie_word_embeddings", "max_position_embeddings"):
        assert getattr(q, key) == hf[key], key
    # §7: 256 prompts x 8 rollouts, mini-batch 64 (4 updates), 1 epoch, T 1.0 / top-p 1.0, 15,360 new tokens
    assert (cfg.trainer.train_batch_size, cfg.rollout.n, cfg.actor.ppo_mini_batch_size, cfg.actor.ppo_epochs) == (
        256, 8, 64, 1)
    assert (cfg.rollout.temperature, cfg.rollout.top_p, cfg.rollout.max_new_tokens) == (1.0, 1.0, 15360)
    assert cfg.data.max_prompt_length + cfg.rollout.max_new_tokens <= hf["max_position_embeddings"]
    o = cfg.actor.optim
    assert (o.lr, o.warmup_steps) == (1e-6, 10)
    # §4-5: clip 0.2 / 0.28 (GRPO 0.2 / 0.2), token-mean, no KL, no entropy bonus, no dynamic sampling
    assert (cfg.actor.clip_ratio_low, cfg.actor.clip_ratio_high) == (0.2, 0.2 if recipe == "grpo" else 0.28)
    assert cfg.actor.loss_agg_mode == "token-mean" and cfg.actor.entropy_coeff == 0.0
    assert not cfg.actor.use_kl_loss and cfg.actor.kl_loss_coef == 0.0 and not cfg.sampling.dynamic
    assert cfg.s2t.enabled == (recipe == "stapo") and cfg.top_entropy.enabled == (recipe == "entropy20")
    assert (cfg.s2t.tau_p, cfg.s2t.entropy_quantile, cfg.s2t.quantile_scope) == (0.002, 0.8, "minibatch")
    assert cfg.top_entropy.ratio == 0.2
    # issue 13: the hardened math reward, except the JustRL baseline, which keeps JustRL's strict-box matcher
    assert cfg.reward.kind == ("boxed_exact_pm1" if recipe == "justrl" else "math_verify_strict")
    assert cfg.algorithm.adv_estimator == "grpo"
    assert cfg.data.prompt_suffix.endswith("put your final answer within \\boxed{}.")
    # §8: evaluation protocol
    assert cfg.eval.n_samples == {"aime24": 32, "aime25": 32, "amc23": 32, "math500": 4, "minerva_math": 4,
                                  "olympiadbench": 4}
    assert cfg.eval.max_new_tokens == 31744
    # §10.15: total_steps must be chosen by the user; with it (and the data placeholder) the run is ready
    with pytest.raises(ConfigError, match="trainer.total_steps"):
        cfg.check_rl_ready()
    load_config(path, ["trainer.total_steps=100"]).check_rl_ready()
    # the mini-batch splits over every mesh preset's data shards
    for mesh in MESHES:
        m = yaml.safe_load(mesh.read_text())["mesh"]
        assert cfg.grad_accum_steps(m["data"] * m["fsdp"]) >= 1


def run_script(args, **env):
    return subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "DRY_RUN": "1", **env})


def test_single_host_dry_run():
    out = run_script(["bash", "launch/single_host.sh", "configs/paper/qwen3-1.7b-base-stapo.yaml",
                      "trainer.total_steps=5"], MESH="configs/mesh/gpu-8xh200.yaml")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [".venv/bin/stapo-jax", "train", "--config", "configs/paper/qwen3-1.7b-base-stapo.yaml",
                                  "mesh.data=1", "mesh.fsdp=8", "mesh.tensor=1", "trainer.total_steps=5"]
    bad = run_script(["bash", "launch/single_host.sh", "configs/nope.yaml"])
    assert bad.returncode == 2 and "config not found" in bad.stderr


def test_tpu_pod_dry_run_starts_the_same_program_on_all_workers():
    out = run_script(["bash", "launch/tpu_pod.sh", "run", "my-v5p", "us-east5-a",
                      "configs/paper/qwen3-14b-base-stapo.yaml", "trainer.total_steps=5",
                      "data.train_files=[a b.jsonl]"], PROJECT="proj")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 3 and all("--worker=all" in x and "--zone us-east5-a" in x and "--project proj" in x
                                   for x in lines)
    assert lines[0].startswith("gcloud compute tpus tpu-vm scp") and "jax\\[tpu\\]" in lines[1]
    b64 = re.search(r"echo\\ ([A-Za-z0-9+/=]+)\\ \\\|\\ base64", lines[2]).group(1)
    script = base64.b64decode(b64).decode().splitlines()
    mesh = [f"mesh.{k}={v}" for k, v in yaml.safe_load(
        (REPO / "configs/mesh/tpu-v5p-64.yaml").read_text())["mesh"].items()]
    assert script[0] == "export STAPO_DISTRIBUTED=on" and script[2] == "echo $? > logs/exit-code"
    assert script[1].split()[:4] == [".venv/bin/stapo-jax", "train", "--config", "configs/paper/qwen3-14b-base-stapo.yaml"]
    assert script[1].split()[4:4 + len(mesh)] == mesh
    assert r"data.train_files=\[a\ b.jsonl\]" in script[1]  # quoted for the remote shell
    assert "logs/worker-\\$W.log" in lines[2]
    stop = run_script(["bash", "launch/tpu_pod.sh", "stop", "my-v5p", "z"])
    assert "--worker=all" in stop.stdout and "pkill\\ -TERM\\ -P" in stop.stdout
    assert run_script(["bash", "launch/tpu_pod.sh", "frobnicate", "n", "z"]).returncode == 2


def test_slurm_script_is_valid_and_documents_jax_distributed():
    text = (REPO / "launch/slurm.sbatch").read_text()
    assert subprocess.run(["bash", "-n", "launch/slurm.sbatch"], cwd=REPO).returncode == 0
    for needle in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID=$SLURM_PROCID",
                   "JAX_LOCAL_DEVICE_IDS=$SLURM_LOCALID", "#SBATCH --requeue", "#SBATCH --signal=TERM@120"):
        assert needle in text, needle


def test_overrides_from_yaml(tmp_path):
    (tmp_path / "p.yaml").write_text("mesh: {data: 2, fsdp: 4}\nactor: {optim: {betas: [0.9, 0.95]}}\n")
    out = subprocess.run([sys.executable, "launch/overrides_from_yaml.py", str(tmp_path / "p.yaml")], cwd=REPO,
                         capture_output=True, text=True)
    assert out.stdout.split() == ["mesh.data=2", "mesh.fsdp=4", "actor.optim.betas=[0.9,", "0.95]"]
    cfg = load_config(REPO / "configs/paper/qwen3-8b-base-stapo.yaml", out.stdout.strip().splitlines())
    assert (cfg.mesh.data, cfg.mesh.fsdp, cfg.actor.optim.betas) == (2, 4, (0.9, 0.95))
    bad = subprocess.run([sys.executable, "launch/overrides_from_yaml.py", str(tmp_path / "none.yaml")], cwd=REPO,
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "none.yaml" in bad.stderr


def test_prepare_dapo_math(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    sys.path.insert(0, str(REPO / "launch"))
    try:
        import prepare_dapo_math as prep
    finally:
        sys.path.pop(0)
    wrap = lambda q: [{"role": "user", "content": prep.DAPO_PREFIX + q + prep.DAPO_SUFFIX}]  # noqa: E731
    rows = [{"prompt": wrap("What is $1+1$?"), "reward_model": {"ground_truth": "2"}}] * 3 + [
        {"prompt": wrap("Answer: find x."), "reward_model": {"ground_truth": "5"}},
        {"prompt": None, "reward_model": {"ground_truth": "3"}}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    out = tmp_path / "dapo.jsonl"
    assert prep.convert(str(tmp_path), out) == {"rows": 5, "written": 2, "duplicates": 2, "bad": 1}
    got = [json.loads(x) for x in out.read_text().splitlines()]
    assert [(g["problem"], g["answer"]) for g in got] == [("What is $1+1$?", "2"), ("Answer: find x.", "5")]
    cfg = load_config(REPO / "configs/paper/qwen3-1.7b-base-stapo.yaml",
                      [f"data.train_files=[{out}]", "trainer.total_steps=1"])
    from stapo_jax.data.prompts import load_prompt_dataset
    from stapo_jax.data.tokenizer import build_builtin_tokenizer
    ds = load_prompt_dataset(cfg, build_builtin_tokenizer())
    assert len(ds) == 2 and ds.examples[0]["answer"] == "2"
    assert prep.convert(str(tmp_path / "train.parquet"), out, keep_duplicates=True)["written"] == 4
