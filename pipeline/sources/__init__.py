"""Where a source model comes from: converters from Hugging Face checkpoints and the synthetic demo model."""
