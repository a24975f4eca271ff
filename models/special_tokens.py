"""Qwen3's special token ids, the one definition (conventions.md §6; Qwen3 ``tokenizer_config.json`` /
``generation_config.json``). JAX-free, so the tokenizer and config code can import it.

``<|endoftext|>`` (151643): the BOS id of every Qwen3 config, the -Base models' EOS, and the pad id.
``<|im_end|>`` (151645): the instruct models' EOS (end of a chat turn). Both stop generation.
"""

QWEN3_ENDOFTEXT_ID = 151643
QWEN3_IM_END_ID = 151645
QWEN3_STOP_IDS = (QWEN3_ENDOFTEXT_ID, QWEN3_IM_END_ID)
