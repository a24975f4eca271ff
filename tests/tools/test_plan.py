"""``stapo-jax plan`` on 8 simulated devices against the real thing: the abstract (no weights) train step and
rollout decode step must compile to exactly the memory XLA reports for the same programs built from real,
allocated arrays (``TrainState.create``, ``Qwen3Engine``); the analytic FLOPs must match XLA's count where XLA's
count is exact (every loop runs once); and the CLI gives a fit verdict."""
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from stapo_jax.tools import plan
from stapo_jax.config.schema import load_config

REPO = Path(__file__).resolve().parents[2]
TINY = """
model: {{preset: null, vocab_size: 512, hidden_size: {d}, intermediate_size: {f}, num_hidden_layers: {layers},
        num_attention_heads: 4, num_key_value_heads: 2, head_dim: {h}, max_position_embeddings: 256,
        tie_word_embeddings: false, dtype: float32, param_dtype: float32, remat: {remat}}}
tokenizer: {{kind: builtin}}
data: {{max_prompt_length: 16}}
rollout: {{n: 4, max_new_tokens: 32, max_concurrent_decodes: 8}}
actor: {{ppo_mini_batch_size: {mini}, ppo_micro_batch_size: 1, logprob_seq_chunk: {chunk}}}
trainer: {{train_batch_size: 8}}
algorithm: {{recipe: {recipe}}}
"""


def tiny_cfg(tmp_path, layers=2, remat="none", mini=4, chunk=8, recipe="stapo", d=64, f=128, h=16, overrides=()):
    p = tmp_path / "tiny.yaml"
    p.write_text(TINY.format(layers=layers, remat=remat, mini=mini, chunk=chunk, recipe=recipe, d=d, f=f, h=h))
    return load_config(p, list(overrides)), p


def slot_bound_lengths():
    """[16] sequence lengths (of P + R = 16 + 32) for which the trainer's token-budget layout on 8 shards of 1
    padded row each is the plan's bound: 6 full-length sequences, 40 + 8 tokens, and 8 two-token sequences that
    lightest-first sends to one micro-batch (n_max = 9 uncapped, 8 at the default cap of 8 x 1)."""
    return np.random.default_rng(0).permutation(np.array([48] * 6 + [40, 8] + [2] * 8))


def shard_nbytes(tree):
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("opt_state,layout", [("trainer", "slots"), ("replicated", "packed rows")])
def test_plan_equals_real_compiled_programs(tmp_path, opt_state, layout):
    """``slots``: STAPO with a mini-batch-scoped S2T mask, so the trainer chooses micro-batches by tokens; the
    real batch is the trainer's slot layout (``token_budget_micro_batches`` + ``gather_slots``) of lengths that
    reach the plan's bound (n_max = 8 > 1 sequence per padded micro-batch). ``packed rows``: a micro-batch-scoped
    S2T mask (the update depends on a row's micro-batch): full-length sequences packed one per row."""

    from models.qwen3 import Qwen3
    from models.qwen3_config import Qwen3Config
    from models.sharding import make_mesh
    from stapo_jax.train.optim import make_optimizer
    from stapo_jax.config.recipes import get_recipe
    from stapo_jax.rollout import engine as eng
    from stapo_jax.rollout.decode_fns import step_fn
    from stapo_jax.rollout.sampling import SamplingParams
    from stapo_jax.train.packing import gather_slots, pack_micro_batches
    from stapo_jax.train.train_step import Batch, TrainState, batch_sharding, make_train_step
    from stapo_jax.train.micro_batches import token_budget_micro_batches

    scope = "minibatch" if layout == "slots" else "microbatch"
    cfg, _ = tiny_cfg(tmp_path, overrides=[f"s2t.quantile_scope={scope}"])
    spec = plan.make_spec(cfg, mesh="data=2,fsdp=4,tensor=1", opt_state=opt_state)
    assert spec["devices"] == 8 and spec["num_micro_batches"] == 2 and spec["mini_batch_sequences"] == 16
    result = plan.run_plan(spec)
    planned = result["train"]["layout"]
    assert planned["kind"] == layout

    # ---- the real side: allocated parameters, optimizer state, batch, engine
    qcfg = Qwen3Config(**spec["model"])
    mesh = make_mesh(data=2, fsdp=4, tensor=1)
    o = spec["optim"]
    opt = make_optimizer(o["lr"], o["warmup_steps"], o["weight_decay"], o["clip_grad"], o["betas"], o["eps"])
    model = Qwen3(qcfg, rngs=nnx.Rngs(0))
    with jax.set_mesh(mesh):
        state = TrainState.create(model, opt, mesh)
        if opt_state == "replicated":  # the what-if: moments as a plain jit(optimizer.init) places them
            state = state.replace(opt_state=jax.jit(opt.init)(state.params))
        shardings = jax.tree.map(lambda x: x.sharding, state)
        b, t, r = 16, 48, 32
        if layout == "slots":  # the trainer's token-budget slot layout of lengths that reach the bound
            lengths = slot_bound_lengths()
            prompt = np.minimum(lengths - 1, 16)
            cols = np.arange(t)[None]
            mask = (cols >= 16 - prompt[:, None]) & (cols < 16 + (lengths - prompt)[:, None])
            k, slots = token_budget_micro_batches(mask, mini_rows=16, num_micro_batches=2, num_shards=8,
                                                  max_sequences=cfg.actor.sequences_cap())
            assert (k, len(slots), len(slots) // (8 * k)) == (planned["micro_batches"], planned["rows"], 8)
            assert planned["n_max"] == 8 and planned["rows"] == 64
            rows = {"input_ids": gather_slots(np.where(mask, 7, 0).astype(np.int32), slots),
                    "attention_mask": gather_slots(mask, slots), "advantages": gather_slots(np.ones(b, np.float32),
                                                                                            slots)}
        else:  # full-length sequences pack one per row, the plan's worst case of that layout
            k = 2
            rows = {"input_ids": np.zeros((b, t), np.int32), "attention_mask": np.ones((b, t), bool),
                    "advantages": np.ones(b, np.float32)}
        n = len(rows["advantages"])
        step = make_train_step(get_recipe("stapo", s2t={"quantile_scope": scope}), opt, num_micro_batches=k,
                               seq_chunk=8, vocab_size=512, mesh=mesh, state_shardings=shardings, donate=True)
        bs = batch_sharding(mesh)
        put = lambda x: jax.device_put(x, bs)  # noqa: E731
        batch = Batch(input_ids=put(rows["input_ids"]), attention_mask=put(rows["attention_mask"]),
                      response_mask=put(rows["attention_mask"][:, -r:].astype(np.int32)),
                      advantages=put(rows["advantages"]), old_log_probs=put(jnp.zeros((n, r), jnp.float32)),
                      old_entropy=put(jnp.zeros((n, r), jnp.float32)))  # as the trainer passes it (S2T correction)
        assert spec["use_remove_padding"]  # model.use_remove_padding (default)
        batch = batch.replace(packing=jax.tree.map(put, pack_micro_batches(
            rows["input_ids"], rows["attention_mask"], r, num_micro_batches=k, num_shards=8, long_rows=False)))
        assert batch.packing.input_ids.shape == (planned["packed_rows"], planned["row_length"])
        real_train = step.lower(state, batch).compile().memory_analysis()
        # the plan models an accelerator run's engine, whose kernels are held in_out whatever this host prefers
        engine = eng.Qwen3Engine(model, eng.EngineConfig(max_concurrent_decodes=8, max_prefill_length=16,
                                                         max_decode_length=32, kernel_layout="in_out"), mesh=mesh)
        dstate = engine.init_decode_state(0)
        real_decode = step_fn.lower(engine.decode_spec, engine.load_params(), dstate,
                                    SamplingParams()).compile().memory_analysis()

    t_plan, d_plan = result["train"], result["decode"]
    for key in ("argument", "output", "alias", "temp"):
        assert t_plan["memory"][key] == getattr(real_train, f"{key}_size_in_bytes"), ("train", key)
        assert d_plan["memory"][key] == getattr(real_decode, f"{key}_size_in_bytes"), ("decode", key)
    assert t_plan["params_bytes"] == shard_nbytes(state.params)
    # the slot layout's batch arrays: 8 slots per device (n_max = 8), not the padded 2 rows per device
    assert t_plan["batch_bytes"] == shard_nbytes(batch)
    if layout == "slots":
        # per slot: input_ids + attention_mask [48]; response_mask, old_log_probs, old_entropy, response_index
        # [32] x 4 bytes; advantages; plus one packed row of 48 tokens x 3 int32 arrays per device
        per_slot = 48 * (4 + 1) + 32 * 4 * 4 + 4
        assert t_plan["batch_bytes"] == 8 * per_slot + 1 * 48 * 3 * 4
    assert t_plan["opt_state_bytes"] == shard_nbytes(state.opt_state)
    assert d_plan["kv_cache_bytes"] == shard_nbytes((dstate.cache.k, dstate.cache.v))
    # analytic cross-checks: parameter count, and the KV cache split evenly over the 8 slot shards
    a = result["analytic"]
    assert a["params"] == sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert a["kv_cache_bytes_ideal"] == d_plan["kv_cache_bytes"] == 2 * 2 * 8 * 48 * 2 * 16 * 4 / 8
    ideal = a["params"] * 4 / 4  # fsdp=4 shards, f32
    assert t_plan["params_bytes"] == pytest.approx(ideal, rel=0.02)  # only norms (replicated) deviate
    if opt_state == "trainer":  # TrainState.create shards the AdamW moments like their parameters
        assert t_plan["opt_state_bytes"] == pytest.approx(2 * ideal, rel=0.02)
    else:
        assert t_plan["opt_state_bytes"] == pytest.approx(2 * ideal * 4, rel=0.02)
    report = plan.format_report(result)
    assert "train step (one mini-batch update)" in report and "KV cache" in report


def test_analytic_flops_match_xla_when_every_loop_runs_once(tmp_path):
    """XLA's cost analysis counts a while-loop body once; with 1 layer, 1 micro-batch and one sequence chunk every
    loop runs once, so its count is the program's true count and must agree with the analytic formula (which
    counts matmuls only; elementwise work, the optimizer and the diagnostics add ~10% at this size). Without remat:
    XLA:CPU's count of a checkpointed single-iteration scan does not include the recompute."""
    cfg, _ = tiny_cfg(tmp_path, layers=1, remat="none", mini=2, chunk=32, d=512, f=2048, h=128)
    spec = plan.make_spec(cfg, mesh="data=8,fsdp=1,tensor=1")
    assert spec["num_micro_batches"] == 1
    result = plan.run_plan(spec)
    xla_train = result["train"]["flops_per_device"] * spec["devices"]
    xla_decode = result["decode"]["flops_per_device"] * spec["devices"]
    # matmuls are a lower bound; AdamW, clipping, softmaxes and the S2T diagnostics add ~10% at this size. XLA
    # counts both branches' work of the S2T correction conditional: compare with the every-micro-batch-redone count
    a = result["analytic"]
    assert a["train_flops_per_update_max"] == 2 * a["train_flops_per_update"]  # no remat: 3 forwards, twice
    assert a["train_flops_per_update"] == pytest.approx(3 * a["forward_flops_per_sequence"] * spec["mini_batch_sequences"])
    assert a["train_flops_per_update_max"] <= xla_train <= 1.15 * a["train_flops_per_update_max"]
    assert xla_decode == pytest.approx(result["analytic"]["decode_flops_per_step"], rel=0.03)


def test_make_spec_paper_configs_and_errors(tmp_path):
    cfg = load_config(REPO / "configs/paper/qwen3-14b-base-stapo.yaml")
    spec = plan.make_spec(cfg, mesh="tpu-v5p-64")
    assert spec["mesh"] == {"data": 1, "fsdp": 4, "tensor": 8} and spec["devices"] == 32
    assert spec["hbm_gb"] == 95.0 and spec["device_kind"] == "tpu-v5p"
    assert (spec["mini_batch_sequences"], spec["num_micro_batches"], spec["updates_per_step"]) == (512, 128, 4)
    assert (spec["prompt_length"], spec["response_length"]) == (1024, 15360)
    from models.qwen3 import param_count
    from models.qwen3_config import Qwen3Config
    assert param_count(Qwen3Config(**spec["model"])) == 14_768_307_200  # Qwen3-14B (conventions.md §6: 14.768B)
    a = plan.analytic(spec, Qwen3Config(**spec["model"]))
    assert a["params"] == 14_768_307_200
    # the update runs forward + backward + the full-remat recompute of the decoder (not the LM head): HFU's FLOPs
    # are between 1.25 and 4/3 of MFU's 3 forwards (S2T's correction method: no pre-pass)
    assert 1.25 < a["train_flops_per_update"] / (3 * a["forward_flops_per_sequence"] * 512) < 4 / 3
    small = plan.make_spec(load_config(REPO / "configs/paper/qwen3-1.7b-base-stapo.yaml"),
                           mesh=str(REPO / "configs/mesh/gpu-8xh200.yaml"))
    assert small["hbm_gb"] == 141.0 and small["devices"] == 8 and small["num_micro_batches"] == 64
    assert plan.make_spec(cfg, mesh="data=1,fsdp=-1,tensor=2", devices=64)["mesh"]["fsdp"] == 32
    # the run's actor.token_mask, not its recipe's default mask, is what the plan compiles
    from stapo_jax.tools.plan_analytic import spec_recipe
    assert spec_recipe(spec).token_mask == "s2t"
    off = load_config(REPO / "configs/paper/qwen3-14b-base-stapo.yaml",
                      ["actor.token_mask=none", "algorithm.strict_recipe=false"])
    assert spec_recipe(plan.make_spec(off, mesh="tpu-v5p-64")).token_mask == "none"
    with pytest.raises(plan.PlanError, match="pass --devices"):
        plan.make_spec(cfg, mesh="data=1,fsdp=-1")
    with pytest.raises(plan.PlanError, match="unknown axis 'pipe'"):
        plan.make_spec(cfg, mesh="pipe=2")
    with pytest.raises(plan.PlanError, match="has 8 devices, --devices says 16"):
        plan.make_spec(cfg, mesh="fsdp=8", devices=16)
    with pytest.raises(plan.PlanError, match="ppo_micro_batch_size"):  # 512 sequences / 64 shards = 8, not / 3
        plan.make_spec(load_config(REPO / "configs/paper/qwen3-14b-base-stapo.yaml",
                                   ["actor.ppo_micro_batch_size=3"]), mesh="fsdp=64")
    with pytest.raises(plan.PlanError, match="no such file"):
        plan.make_spec(cfg, mesh="tpu-v9-1024")


def test_cli_fit_verdict(tmp_path, capsys):
    _, path = tiny_cfg(tmp_path)
    rc = plan.main(["--config", str(path), "--mesh", "data=2,fsdp=4,tensor=1", "--only", "train",
                    "--hbm-gb", "1e-6", "--json", str(tmp_path / "plan.json")])
    out = capsys.readouterr().out
    assert rc == 1 and "train step:" in out and "DOES NOT FIT" in out
    assert "K'=1 micro-batches of n_max=8 sequence slots per device" in out and "64 slot rows (8 per device" in out
    import json
    data = json.loads((tmp_path / "plan.json").read_text())
    assert data["spec"]["devices"] == 8 and "decode" not in data and data["train"]["memory"]["temp"] > 0
    assert math.isclose(plan.fits({**data, "spec": {**data["spec"], "hbm_gb": 1.0}}), True)
    assert plan.main(["--config", str(path), "--mesh", "nope=1"]) == 2


def test_packed_slot_bound_is_reached_and_capped(tmp_path):
    """The plan's bound on the trainer's token-budget slot layout: reached by ``token_budget_slots`` (uncapped:
    n_max = mini_rows - S + 1 = 9 on 8 shards of 16 sequences; at the default cap 8 x ppo_micro_batch_size: 8),
    and for the paper's 14B config on a v5p-64 slice (4 data-parallel shards, K = 128 padded micro-batches of 1
    sequence): K' = 126 micro-batches of 8 slots, 1,008 slots per device instead of 128."""
    from stapo_jax.core.errors import ConfigError
    from stapo_jax.tools.plan_analytic import packed_slot_bound
    from stapo_jax.train.packing import token_budget_slots

    lengths = slot_bound_lengths()
    for cap, n_max in ((16, 9), (8, 8)):
        k, slots = token_budget_slots(lengths, mini_rows=16, num_micro_batches=2, width=48, num_shards=8,
                                      max_sequences=cap)
        bound = packed_slot_bound(16, 2, 8, 48, cap)
        assert (k, len(slots) // (8 * k)) == (bound["micro_batches"], bound["n_max"]) == (1, n_max)
        assert bound["slots"] == len(slots) == 8 * n_max
    # random length mixes never exceed the bound (slots, and sequences per micro-batch)
    rng = np.random.default_rng(1)
    for _ in range(30):
        lengths = rng.integers(2, 49, 32)
        k, slots = token_budget_slots(lengths, mini_rows=32, num_micro_batches=4, width=48, num_shards=2,
                                      max_sequences=8)
        bound = packed_slot_bound(32, 4, 2, 48, 8)
        assert len(slots) <= bound["slots"] and len(slots) // (2 * k) <= bound["n_max"] <= 8
    b14 = packed_slot_bound(512, 128, 4, 1024 + 15360, 8)
    assert (b14["micro_batches"], b14["n_max"], b14["slots"] // 4) == (126, 8, 1008)
    assert packed_slot_bound(512, 128, 4, 16384, 1)["slots"] == 512  # cap 1 = the padded layout
    with pytest.raises(ValueError, match="num_micro_batches=3"):
        packed_slot_bound(16, 3, 8, 48, 8)
    cfg = load_config(REPO / "configs/paper/qwen3-14b-base-stapo.yaml")
    assert cfg.actor.sequences_cap() == 8 and plan.make_spec(cfg, mesh="tpu-v5p-64")["max_sequences"] == 8
    with pytest.raises(ConfigError, match="actor.max_sequences_per_micro_batch=2 must be null or >= "
                                          "actor.ppo_micro_batch_size=4"):
        load_config(REPO / "configs/paper/qwen3-14b-base-stapo.yaml",
                    ["actor.ppo_micro_batch_size=4", "actor.max_sequences_per_micro_batch=2"])
