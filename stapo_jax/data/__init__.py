"""Prompt datasets (load, validate, template, tokenize, shard with Grain) and the Qwen3 tokenizer."""
