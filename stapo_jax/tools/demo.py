"""``stapo-jax demo``: load or build a Qwen3, encode a prompt with a real tokenizer, greedy-decode, print.

Model sources (one of):

* ``--model PATH_OR_HUB_ID``: an HF Qwen3 checkpoint (config.json + safetensors) via ``models.hf``;
* ``--preset NAME``: a preset architecture (``models.presets``, e.g. Qwen3-0.6B) with random weights;
* default: a tiny random Qwen3 (2 layers, hidden 64) with the full Qwen3 vocabulary, which runs in seconds
  on a CPU. Its continuation is meaningless text; the point is the pipeline
  (tokenizer -> prefill -> KV-cache decode steps -> detokenizer).

The tokenizer: ``--tokenizer`` (a directory or an HF hub id, ``transformers.AutoTokenizer``); else the
tokenizer saved with ``--model`` (an HF export such as ``runs/tiny_cpu/hf`` carries its own); else a builtin
one, with a warning when ``--model`` had none: the Qwen3 tokenizer shipped in ``stapo_jax/assets`` when the
model's vocabulary holds it, else the offline character tokenizer (``stapo_jax.data.tokenizer``).
Greedy decoding is ``models.decode.greedy_generate`` (jitted prefill + one-token decode steps).

With N JAX processes (``stapo-jax launch --local N --command demo ...``, a pod or SLURM job) every process
initialises multi-controller JAX (``stapo_jax.runtime.distributed.initialize``), builds the same model (same weights or
seed) on its own local devices (``--mesh`` spans ``jax.local_devices()``) and decodes the single prompt; greedy
decoding makes every replica's output identical and only process 0 prints it.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

log = logging.getLogger(__name__)

DEFAULT_PROMPT = "The capital of France is"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
TINY_ARCH = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16)


def build_parser() -> argparse.ArgumentParser:
    """The command's ``argparse`` parser (see the module docstring for the options).

    Returns an ``argparse.ArgumentParser`` (str / int / bool options, ``--dtype`` float32 or bfloat16);
    building it never raises (parsing bad arguments exits 2). Source: HF transformers ``generate`` option names
    (``max_new_tokens``).
    """
    p = argparse.ArgumentParser(prog="stapo-jax demo", description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="HF Qwen3 checkpoint directory or hub id (config.json + *.safetensors)")
    src.add_argument("--preset", help="preset architecture with random weights, e.g. Qwen3-0.6B")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer directory or hub id (default: the one saved with --model, else the builtin "
                        "Qwen3 tokenizer shipped with the package)")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="prompt text (default: %(default)r)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--max-new-tokens", type=int, default=8, help="tokens to generate (default: %(default)s)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="compute and parameter dtype (default: %(default)s)")
    p.add_argument("--mesh", default=None, metavar="data=D,fsdp=F,tensor=T",
                   help="load --model onto a device mesh (models.sharding.make_mesh); default: one device")
    p.add_argument("--seed", type=int, default=0, help="init seed for random weights (default: %(default)s)")
    return p


def _parse_mesh(spec: str):
    from models.sharding import make_mesh
    try:
        sizes = {k.strip(): int(v) for k, v in (kv.split("=") for kv in spec.split(",") if kv.strip())}
    except ValueError as e:
        raise ValueError(f"--mesh {spec!r}: expected data=D,fsdp=F,tensor=T") from e
    unknown = set(sizes) - {"data", "fsdp", "tensor"}
    if unknown:
        raise ValueError(f"--mesh {spec!r}: unknown axes {sorted(unknown)} (use data, fsdp, tensor)")
    import jax

    # multi-controller: every process holds its own replica on its local devices (the demo has one prompt)
    return make_mesh(**sizes, devices=jax.local_devices())


def load_model(args):
    """(config, model, description) for the parsed arguments (see the module docstring).

    Takes ``args``, the parsed namespace. Returns ``(Qwen3Config, Qwen3 model, str)``; parameters
    in ``args.dtype`` (float32 or bfloat16). Raises ``CheckpointError`` (ValueError) for a bad ``--model``,
    KeyError for an unknown ``--preset``. Source: HF transformers ``from_pretrained`` checkpoint layout
    (:mod:`models.hf`).
    """
    from flax import nnx

    from models.qwen3 import Qwen3
    from models.qwen3_config import Qwen3Config
    if args.model:
        from models.hf import load_hf_checkpoint
        mesh = _parse_mesh(args.mesh) if args.mesh else None
        cfg, model = load_hf_checkpoint(args.model, mesh=mesh, dtype=args.dtype, param_dtype=args.dtype)
        return cfg, model, f"HF checkpoint {args.model}"
    if args.preset:
        from models.presets import preset
        cfg = preset(args.preset, dtype=args.dtype, param_dtype=args.dtype)
        desc = f"preset {args.preset} with random weights (seed {args.seed})"
    else:
        cfg = Qwen3Config(**TINY_ARCH, dtype=args.dtype, param_dtype=args.dtype)
        desc = f"tiny random Qwen3 ({TINY_ARCH['num_hidden_layers']} layers, hidden {TINY_ARCH['hidden_size']}, " \
               f"seed {args.seed})"
    return cfg, Qwen3(cfg, rngs=nnx.Rngs(args.seed)), desc


def load_tokenizer(path_or_id: Optional[str], model_path: Optional[str] = None, vocab_size: Optional[int] = None):
    """The demo's tokenizer (module docstring): ``path_or_id``, else ``model_path``'s, else a builtin one.

    Args:
      path_or_id: ``--tokenizer`` (directory or hub id) or None.
      model_path: ``--model`` (directory or hub id) or None; a directory without tokenizer files
        (:data:`TOKENIZER_FILES`) falls back to a builtin tokenizer with a warning.
      vocab_size: the model's vocabulary size; picks the builtin tokenizer (the shipped Qwen3 one if it fits,
        else the character tokenizer). None = the shipped Qwen3 tokenizer.
    Returns:
      a ``transformers`` fast tokenizer.
    Raises:
      OSError: transformers cannot load ``path_or_id`` (a missing directory or an unknown hub id).

    Str / int arguments; ``vocab_size`` an int token count. Source: HF transformers
    ``AutoTokenizer.from_pretrained``.
    """
    from transformers import AutoTokenizer

    from stapo_jax.assets import qwen3_tokenizer_dir
    if path_or_id is not None:
        return AutoTokenizer.from_pretrained(path_or_id)
    if model_path is not None:
        local = Path(model_path).expanduser()
        if not local.is_dir():                                     # a hub id: its tokenizer comes with it
            return AutoTokenizer.from_pretrained(model_path)
        if any((local / f).is_file() for f in TOKENIZER_FILES):
            return AutoTokenizer.from_pretrained(str(local))
    qwen3 = AutoTokenizer.from_pretrained(str(qwen3_tokenizer_dir()))
    if vocab_size is None or len(qwen3) <= vocab_size:
        if model_path is not None:
            log.warning("%s holds no tokenizer; using the builtin Qwen3 tokenizer (pass --tokenizer DIR_OR_HUB_ID "
                        "to choose another)", model_path)
        return qwen3
    from stapo_jax.data.tokenizer import build_builtin_tokenizer

    log.warning("%s holds no tokenizer and its vocabulary (%d) is smaller than Qwen3's (%d); using the builtin "
                "character tokenizer (pass --tokenizer DIR_OR_HUB_ID to choose another)", model_path, vocab_size,
                len(qwen3))
    return build_builtin_tokenizer()


def run(args) -> dict:
    """Encode, greedy-decode and decode; returns the printed record.

    Returns:
      dict with ``model``, ``prompt``, ``prompt_ids`` (list[int]), ``generated_ids`` (list[int], up to and
      including the first EOS), ``text`` (decoded generated ids, special tokens kept), ``seconds``.
    Raises:
      ValueError: ``--max-new-tokens`` < 1, an empty prompt, or token ids outside the model's vocabulary.
    """
    import numpy as np

    from models.decode import greedy_generate
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens={args.max_new_tokens} must be >= 1")
    cfg, model, desc = load_model(args)
    tok = load_tokenizer(args.tokenizer, args.model, cfg.vocab_size)
    if args.chat:
        ids = tok.apply_chat_template([{"role": "user", "content": args.prompt}], tokenize=True,
                                      add_generation_prompt=True)
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    else:
        ids = tok(args.prompt, add_special_tokens=False)["input_ids"]
    if not ids:
        raise ValueError("--prompt encodes to no tokens")
    if len(ids) + args.max_new_tokens > cfg.max_position_embeddings:
        raise ValueError(f"prompt ({len(ids)} tokens) + --max-new-tokens ({args.max_new_tokens}) exceeds the model's "
                         f"max_position_embeddings ({cfg.max_position_embeddings})")
    if max(ids) >= cfg.vocab_size:
        raise ValueError(f"prompt token id {max(ids)} is outside the model vocabulary ({cfg.vocab_size}); "
                         f"tokenizer and model do not match")
    t0 = time.perf_counter()
    tokens, lengths = greedy_generate(model, np.asarray([ids], np.int32), np.ones((1, len(ids)), np.int32),
                                      args.max_new_tokens, eos_token_ids=cfg.eos_token_ids)
    seconds = time.perf_counter() - t0
    generated = [int(t) for t in tokens[0, : int(lengths[0])]]
    return {"model": desc, "prompt": args.prompt, "prompt_ids": [int(i) for i in ids], "generated_ids": generated,
            "text": tok.decode(generated, skip_special_tokens=False), "seconds": round(seconds, 3)}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``stapo-jax demo``; returns the exit code (0 ok, 2 bad input: message on stderr).

    ``argv`` a sequence of str, returns an int. ValueError / KeyError / FileNotFoundError / OSError are
    printed, not raised (exit 2); argparse errors exit 2.
    """
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    import jax

    from stapo_jax.runtime.distributed import initialize

    initialize()  # N processes (launch --local N, pod, SLURM): before any device is touched; no-op for one
    try:
        rec = run(args)
    except (ValueError, KeyError, FileNotFoundError, OSError) as e:   # CheckpointError is a ValueError
        print(f"stapo-jax demo: error: {e}", file=sys.stderr)
        return 2
    if jax.process_index() != 0:  # every process decoded the same greedy continuation; process 0 prints it
        return 0
    print(f"model:         {rec['model']}")
    print(f"prompt:        {rec['prompt']!r}")
    print(f"prompt_ids:    {json.dumps(rec['prompt_ids'])}")
    print(f"generated_ids: {json.dumps(rec['generated_ids'])}")
    print(f"text:          {json.dumps(rec['text'], ensure_ascii=False)}")
    print(f"seconds:       {rec['seconds']} (greedy decode incl. compile)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
