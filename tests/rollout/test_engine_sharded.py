"""The engine on 8 simulated CPU devices (mesh data=2, fsdp=2, tensor=2: slots and KV heads sharded,
parameters by models.sharding rules) returns the same tokens as on 1 device, also after a weight sync
(set_params into its sharded buffers) equal to a fresh 1-device engine of the new weights. Runs in its own
subprocess so the device count is set before JAX starts, whatever the parent process has."""
import json
import os
import subprocess
import sys
import textwrap
from xla_env import xla_flags

SCRIPT = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, "tests")
    import jax, numpy as np
    from flax import nnx
    from fixtures_rollout import PROMPTS_SHARDED, make_engine, tiny_model
    from models.sharding import make_mesh
    from stapo_jax.rollout.driver import RolloutDriver
    from stapo_jax.rollout.sampling import SamplingParams

    assert jax.device_count() == 8, jax.devices()
    out = {}
    for name, sampling in (("greedy", SamplingParams(greedy=True)), ("sampled", SamplingParams(0.8, top_k=40))):
        runs = {}
        for mesh_name, mesh in (("one", None), ("eight", make_mesh(2, 2, 2))):
            eng = make_engine(tiny_model(0), slots=4, sampling=sampling, eos_token_ids=(3, 19, 77), mesh=mesh)
            b = RolloutDriver(eng).generate(PROMPTS_SHARDED, num_samples=2, max_new_tokens=10, seed=4)
            runs[mesh_name] = dict(responses=b.responses.tolist(), lp=b.rollout_log_probs.tolist(),
                                   reasons=b.finish_reasons, mask=b.response_mask.tolist())
            if mesh is not None:
                state = eng.init_decode_state()
                params = eng.load_params()
                runs["k_spec"] = str(state.cache.k[0].sharding.spec)
                runs["q_spec"] = str(params.layers[0]["self_attn"]["q_proj"]["kernel"][...].sharding.spec)
                runs["n_devices"] = len(state.cache.k[0].sharding.device_set)
                # weight sync into the sharded engine (layers written into its donated sharded buffers)
                drv = RolloutDriver(eng)
                drv.sync_weights(jax.tree.map(np.asarray, nnx.split(tiny_model(1))[1]))
                b = drv.generate(PROMPTS_SHARDED, num_samples=2, max_new_tokens=10, seed=4)
                runs["synced"] = b.responses.tolist()
                runs["synced_spec"] = str(eng.load_params().layers[0]["self_attn"]["q_proj"]["kernel"][...].sharding.spec)
        one_synced = make_engine(tiny_model(1), slots=4, sampling=sampling, eos_token_ids=(3, 19, 77))
        runs["synced_ref"] = RolloutDriver(one_synced).generate(PROMPTS_SHARDED, num_samples=2, max_new_tokens=10,
                                                                seed=4).responses.tolist()
        out[name] = runs
    print("RESULT" + json.dumps(out))
""")


def test_eight_devices_equal_one_device():
    env = dict(os.environ, XLA_FLAGS=xla_flags(8), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT"))
    out = json.loads(line[len("RESULT"):])
    for name in ("greedy", "sampled"):
        one, eight = out[name]["one"], out[name]["eight"]
        assert eight["responses"] == one["responses"], name
        assert eight["mask"] == one["mask"] and eight["reasons"] == one["reasons"], name
        diff = max(abs(a - b) for ra, rb in zip(one["lp"], eight["lp"]) for a, b in zip(ra, rb))
        assert diff <= 1e-5, (name, diff)
        assert out[name]["n_devices"] == 8
        assert "tensor" in out[name]["k_spec"] and "data" in out[name]["k_spec"], out[name]["k_spec"]
        assert "tensor" in out[name]["q_spec"], out[name]["q_spec"]
        assert out[name]["synced"] == out[name]["synced_ref"], name  # weight sync on 8 devices == fresh engine
        assert out[name]["synced"] != one["responses"], name
        assert out[name]["synced_spec"] == out[name]["q_spec"], name
