"""Generated inputs that the benchmarks and the tests share: tiny GGUF models, a small heal.toml world,
damaged copies of every input kind. Tests import them from here; nothing under bench/ imports tests/.
"""
