"""GGUF files in and out: reading, metadata, tokenizer, writing, importance matrices, llama-quantize recipes."""
